"""MT-Bench's second turns in the benchmark (`jetspec bench --suite mtbench_turn2`): the chats a second turn is
decoded on.

A conversation (`jetspec.prompts.CONVERSATIONS`) holds two user turns. As MT-Bench runs it, turn 1 is the user's
first turn under the chat template; turn 2 is the chat of [user turn 1, the target's answer 1, user turn 2] with the
generation prompt. Every method decodes both turns (turn 1 by that same method, so that a method keeping state across
calls, the `answers` method's cache, has seen answer 1 when it drafts turn 2), and the bench reports turn 2's figures
with turn 1's beside them (`PromptRow.turn1`).

Answer 1 in the turn-2 chat is always plain greedy's: in float32 every method's answer 1 equals it (decoding is
lossless, the bench checks it); in bfloat16/float16 a method may leave it at a numerical tie, and its turn 2 would
then be another prompt. So every method's turn 2 decodes the same tokens, and the turn-1 record says where a
method's own answer differed.
"""

from transformers import PreTrainedTokenizerBase

TURNS = 2  # MT-Bench's conversations: a first turn and the second turn that follows its answer


def conversation_turns(conversation: dict) -> tuple[str, str]:
    """`(user turn 1, user turn 2)` of a conversation row (`{"id", "turns"}`); raises `ValueError` on another shape."""
    turns = conversation.get("turns")
    if not isinstance(turns, list) or len(turns) != TURNS or not all(isinstance(t, str) for t in turns):
        raise ValueError(
            f"expected a conversation of {TURNS} user turns (strings), got {turns!r:.120} in conversation "
            f"{conversation.get('id')!r}"
        )
    return turns[0], turns[1]


def first_prompt(row: dict) -> str:
    """The user turn a suite row opens with: a prompt suite's `prompt`, a conversation's first turn."""
    return row["prompt"] if "prompt" in row else conversation_turns(row)[0]


def answer_text(tokenizer: PreTrainedTokenizerBase, tokens) -> str:
    """The text of an answer as the next turn's chat holds it: its tokens (a list of ids or a tensor of shape `(n,)`)
    decoded without special tokens (the end of turn the target emits is the template's to write), with its outer
    whitespace stripped, as MT-Bench keeps answers."""
    return tokenizer.decode(tokens, skip_special_tokens=True).strip()


def second_turn_chat(tokenizer: PreTrainedTokenizerBase, first: str, answer: str, second: str) -> str:
    """The chat text of turn 2: [user `first`, assistant `answer`, user `second`] under the tokenizer's chat template,
    ending with the assistant header (`add_generation_prompt=True`). The text holds the template's special tokens:
    tokenize it with `add_special_tokens=False`."""
    if tokenizer.chat_template is None:
        raise ValueError(f"expected a tokenizer with a chat_template, got {type(tokenizer).__name__} without one")
    messages = [
        {"role": "user", "content": first},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": second},
    ]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
