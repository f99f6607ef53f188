"""`jetspec serve --answer-cache N`: one `AnswerCache` shared by every request of the server, in process
(`build_handlers`, called as the app calls it, on a tiny random float32 target with a one-token-per-character
tokenizer).

a) The same request twice: both answers are plain greedy's (the cache is lossless), and the second one drafts from
   the first one's answer: "answers" tokens in its statistics, and fewer target forwards.
b) Two requests that share one call with the cache on: each answer is its lone answer.
c) Refused before serving: a count < 0 and a head without a lookup branch (`tree_lookup` 0), by name.
"""

import pytest
from test_bench import char_tokenizer
from test_serve_protocol import NAME, call, call_together, chat_body, plain, prompt

from jetspec.serve import build_handlers
from jetspec.serve_limits import Limits, answer_cache_for
from jetspec.tiny import tiny_head, tiny_target
from modeling_jetspec import AnswerCache

TEXTS = ["Write a haiku.", "What is 2 + 3?"]


def served(answers: int, max_batch: int = 1):
    target = tiny_target("llama", vocab_size=100, max_position_embeddings=1024)
    head = tiny_head(target, tree_depth=4, tree_width=3, tree_budget=12, tree_lookup=6)
    chat, completions = build_handlers(target, char_tokenizer(), head, NAME, Limits(answer_cache=answers), max_batch)
    return target, chat


def report(answer: dict) -> dict:
    return answer["jetspec"]


@pytest.fixture(scope="module")
def cached():
    return served(8)


def test_the_same_request_twice_is_answered_alike_and_the_second_drafts_from_the_first(cached):
    target, chat = cached
    manager = chat.generation_state.manager
    assert isinstance(manager.answer_cache, AnswerCache) and manager.answer_cache.max_answers == 8
    ids = prompt(chat.model_manager.tokenizer, TEXTS[0])
    want = plain(target, ids, 40)
    _, uncached = served(0)
    assert uncached.generation_state.manager.answer_cache is None
    alone = report(call(uncached, chat_body(TEXTS[0], max_tokens=40, temperature=0)))
    assert alone["token_ids"] == want and alone["tokens_by_source"]["answers"] == 0
    first = report(call(chat, chat_body(TEXTS[0], max_tokens=40, temperature=0)))
    assert len(manager.answer_cache) == 1  # the first answer is kept
    second = report(call(chat, chat_body(TEXTS[0], max_tokens=40, temperature=0, stream=False), "req-2"))
    assert first["token_ids"] == second["token_ids"] == want
    assert first["tokens_by_source"]["answers"] == 0  # an empty cache drafts nothing
    assert second["tokens_by_source"]["answers"] > 0
    assert sum(second["tokens_by_source"].values()) == len(want)
    assert second["target_forwards"] < first["target_forwards"]
    assert len(manager.answer_cache) == 2


def test_requests_sharing_a_call_with_the_cache_on_get_their_lone_answers():
    target, chat = served(8)
    tokenizer = chat.model_manager.tokenizer
    wanted = [plain(target, prompt(tokenizer, text), 20) for text in TEXTS]
    call(chat, chat_body(TEXTS[0], max_tokens=20, temperature=0))  # the cache holds the first answer
    bodies = [chat_body(text, max_tokens=20, temperature=0) for text in TEXTS]
    answers = [report(answer) for answer in call_together(SimpleModel(chat), bodies)]
    assert [answer["batch"] for answer in answers] == [2, 2]
    assert [answer["token_ids"] for answer in answers] == wanted
    assert answers[0]["tokens_by_source"]["answers"] > 0  # the shared call drafted from the cache too
    assert len(chat.generation_state.manager.answer_cache) == 3  # and kept both rows' answers


class SimpleModel:
    """What `call_together` reads of a served model: its chat handler."""

    def __init__(self, chat):
        self.chat = chat


def test_a_negative_count_and_a_head_without_a_lookup_branch_are_refused_by_name():
    target = tiny_target("llama", vocab_size=100, max_position_embeddings=1024)
    head = tiny_head(target, tree_depth=4, tree_width=3, tree_budget=12)  # tree_lookup 0
    assert answer_cache_for(head, 0) is None  # off: any head
    with pytest.raises(ValueError, match=r"expected --answer-cache to be an integer >= 0, got -1"):
        answer_cache_for(head, -1)
    with pytest.raises(ValueError, match=r"lookup branch \(tree_lookup >= 1\) for --answer-cache 4.*tree_lookup=0"):
        build_handlers(target, char_tokenizer(), head, NAME, Limits(answer_cache=4))
