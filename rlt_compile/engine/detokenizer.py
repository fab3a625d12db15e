"""Incremental detokenization and stop-string matching for one sequence.

Each new token decodes only a short window of the tokens (from ``prefix_offset``): the new text is
``decode(window) - decode(window minus the new tokens)``, so the work per token stays constant and
tokenizers that merge bytes or strip leading spaces still produce the text a full decode would.
The first window starts a few tokens inside the prompt, as vLLM's does: a SentencePiece or
word-level tokenizer drops the leading space of a text's first word, so the first output token is
decoded after the prompt's last words and keeps its space (``prompt + text`` reads as
``decode(prompt + output)``). An incomplete UTF-8 character (a trailing U+FFFD) is held back until
the next token completes it.
"""

from __future__ import annotations

from rlt_compile.engine.sequence import Sequence

_WINDOW = 6  # tokens of context kept before the unread ones


def detokenize_step(tokenizer, seq: Sequence) -> str:
    """Append the text of ``seq``'s newest output tokens to ``seq.text``; returns the new text.
    ``seq.prefix_offset`` / ``seq.read_offset`` index ``seq.token_ids`` (prompt and output)."""
    ids = seq.token_ids
    skip = seq.params.skip_special_tokens
    if seq.read_offset < 0:  # the first output tokens: read them after the prompt's last tokens
        seq.prefix_offset, seq.read_offset = _prompt_window(tokenizer, seq.prompt_token_ids, skip)
    prefix = tokenizer.decode(ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=skip)
    full = tokenizer.decode(ids[seq.prefix_offset :], skip_special_tokens=skip)
    if full.endswith("\ufffd"):
        return ""  # an incomplete character: wait for the next token
    new_text = full[len(prefix) :]
    seq.text += new_text
    seq.read_offset = len(ids)
    seq.prefix_offset = max(seq.read_offset - _WINDOW, 0)
    return new_text


def _prompt_window(tokenizer, prompt: list[int], skip: bool) -> tuple[int, int]:
    """The first window: ``_WINDOW`` tokens before the prompt's end, read up to its end, or up to
    the start of a character the prompt leaves incomplete (the output's first tokens complete it,
    and the whole character is then output text, as in vLLM's decode stream)."""
    read = len(prompt)
    start = max(read - _WINDOW, 0)
    while read > start and tokenizer.decode(prompt[start:read], skip_special_tokens=skip).endswith("\ufffd"):
        read -= 1
    return start, read


def find_stop_string(seq: Sequence, new_text_len: int) -> str | None:
    """The first stop string that the newest text completes; truncates ``seq.text`` at it."""
    text = seq.text
    for stop in seq.params.stop_strings:
        start = max(len(text) - new_text_len - len(stop) + 1, 0)
        at = text.find(stop, start)
        if at >= 0:
            end = at + len(stop) if seq.params.include_stop_str_in_output else at
            seq.text = text[:end]
            return stop
    return None
