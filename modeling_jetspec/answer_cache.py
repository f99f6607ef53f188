"""Earlier answers as a drafting source across `generate` calls (arXiv 2606.18394, section 3.3, the model-free branch).

The continuation trie (`continuations.py`) drafts from the row's own history: its prompt and what it has committed.
An [`AnswerCache`] keeps the answers of earlier calls in the same process (the last `max_answers`, at most
`max_tokens` tokens in all, the oldest evicted first), as SuffixDecoding keeps a cache of earlier outputs across
requests, and proposes every earlier continuation of the row's last n tokens (n = 3, else 2, else 1) in those
answers. The continuations are counted into a trie and laid into the head's best-first tree beside the row's own
trie (`continuations.merge_children`), scored as the trie's are: the head's `tree_lookup_prior` survival ratio of the
match's order at each depth, times the child's share of its parent's count. Under a calibration map they are
"answers" nodes (`calibration.node_source`).

Opt in per call, with one cache shared by as many calls (and threads) as wanted:

    cache = AnswerCache()
    target.generate(**inputs, assistant_model=head, jetspec_answer_cache=cache)

At the end of every call, each row's new tokens (the prompt excluded) are added to the cache. The prompt is left out
because the row's own trie already reads it (prompt lookup), and because prompts (system prompts, pasted documents)
would spend the memory bound on text the target did not write. Lossless whatever the cache holds: the target
verifies every drafted token.
"""

import threading
from collections import OrderedDict, deque
from itertools import islice

import torch

from .continuations import MAX_OCCURRENCES, count_continuations
from .tree import LOOKUP_MAX_NGRAM

DEFAULT_MAX_ANSWERS = 256
DEFAULT_MAX_TOKENS = 1 << 18  # 262144 tokens, about 3 index entries each


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"expected {name} to be an integer >= 1, got {value!r}")
    return value


def _token_list(token_ids) -> list:
    """`token_ids` (a 1-D integer tensor, or a list or tuple of ints) as a list of ints >= 0."""
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() != 1 or token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool:
            raise ValueError(
                f"expected token_ids as a 1-D integer tensor, got shape {tuple(token_ids.shape)} {token_ids.dtype}"
            )
        token_ids = token_ids.tolist()
    if not isinstance(token_ids, (list, tuple)):
        raise ValueError(f"expected token_ids as a list of ints or a 1-D tensor, got {type(token_ids).__name__}")
    bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int) or t < 0]
    if bad:
        raise ValueError(f"expected token ids that are integers >= 0, got {bad[:5]!r}")
    return list(token_ids)


class AnswerCache:
    """The answers of earlier `generate` calls, indexed by n-gram, bounded and thread-safe.

    Args:
        max_answers (`int`, *optional*, defaults to 256): answers kept; the oldest is evicted first.
        max_tokens (`int`, *optional*, defaults to 262144): tokens kept over all answers; the oldest answers are
            evicted until the new one fits, and an answer longer than this keeps its first `max_tokens` tokens.
    """

    def __init__(self, max_answers: int = DEFAULT_MAX_ANSWERS, max_tokens: int = DEFAULT_MAX_TOKENS):
        self.max_answers = _positive("max_answers", max_answers)
        self.max_tokens = _positive("max_tokens", max_tokens)
        self._lock = threading.Lock()
        self._serial = 0  # the next answer's key
        self._answers = OrderedDict()  # serial -> tokens (a tuple), oldest first
        self._tokens = 0  # tokens held over all answers
        # starts[n - 1][n-gram] -> (serial, start) of every occurrence followed by a token, oldest first
        self._starts = [{} for _ in range(LOOKUP_MAX_NGRAM)]

    def __len__(self) -> int:
        return len(self._answers)

    @property
    def tokens(self) -> int:
        """Tokens held over all answers."""
        return self._tokens

    def answers(self) -> list:
        """The answers held, oldest first, each a list of token ids."""
        with self._lock:
            return [list(answer) for answer in self._answers.values()]

    def add(self, token_ids):
        """Keep one answer (`token_ids`: a 1-D integer tensor or a list of ints), evicting the oldest answers beyond
        the bounds. An answer of fewer than 2 tokens continues nothing and is not kept."""
        answer = tuple(_token_list(token_ids)[: self.max_tokens])
        if len(answer) < 2:
            return
        with self._lock:
            while self._answers and (
                len(self._answers) >= self.max_answers or self._tokens + len(answer) > self.max_tokens
            ):
                self._evict_oldest()
            serial, self._serial = self._serial, self._serial + 1
            self._answers[serial] = answer
            self._tokens += len(answer)
            for n, starts in enumerate(self._starts, start=1):
                for start in range(len(answer) - n):  # occurrences followed by at least one token
                    starts.setdefault(answer[start : start + n], deque()).append((serial, start))

    def _evict_oldest(self):
        """Drop the oldest answer; its occurrences are the oldest of every n-gram's, so each leaves from the left."""
        serial, answer = self._answers.popitem(last=False)
        self._tokens -= len(answer)
        for n, starts in enumerate(self._starts, start=1):
            for start in range(len(answer) - n):
                key = answer[start : start + n]
                found = starts[key]
                found.popleft()
                if not found:
                    del starts[key]

    def clear(self):
        """Forget every answer."""
        with self._lock:
            self._answers.clear()
            self._tokens = 0
            self._starts = [{} for _ in range(LOOKUP_MAX_NGRAM)]

    def trie(
        self, history: list, length: int, max_ngram: int = LOOKUP_MAX_NGRAM, max_occurrences: int = MAX_OCCURRENCES
    ) -> tuple[dict, int]:
        """Counts of every continuation, in the answers held, of `history`'s last n tokens (n = `max_ngram` down to
        1; the first n with an occurrence), up to `length` tokens each, the most recent `max_occurrences`
        occurrences read: `({path: Counter(next token)}, n)` as `continuations.NgramIndex.trie`, `({}, 0)` without
        one."""
        follows, order = [], 0
        with self._lock:
            for n in range(min(max_ngram, LOOKUP_MAX_NGRAM, len(history)), 0, -1):
                found = self._starts[n - 1].get(tuple(history[len(history) - n :]))
                if found:
                    answers = self._answers
                    follows = [answers[s][i + n : i + n + length] for s, i in islice(reversed(found), max_occurrences)]
                    order = n
                    break
        return count_continuations(follows), order
