"""Incremental detokenization and stop-string matching for one sequence.

Each new token decodes only a short window of the output (from ``prefix_offset``): the new text is
``decode(window) - decode(window minus the new tokens)``, so the work per token stays constant and
tokenizers that merge bytes or strip leading spaces still produce the text a full decode would.
An incomplete UTF-8 character (a trailing U+FFFD) is held back until the next token completes it.
"""

from __future__ import annotations

from rlt_compile.engine.sequence import Sequence

_WINDOW = 6  # tokens of context kept before the unread ones


def detokenize_step(tokenizer, seq: Sequence) -> str:
    """Append the text of ``seq``'s newest output tokens to ``seq.text``; returns the new text."""
    ids = seq.output_token_ids
    skip = seq.params.skip_special_tokens
    prefix = tokenizer.decode(ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=skip)
    full = tokenizer.decode(ids[seq.prefix_offset :], skip_special_tokens=skip)
    if full.endswith("\ufffd"):
        return ""  # an incomplete character: wait for the next token
    new_text = full[len(prefix) :]
    seq.text += new_text
    seq.read_offset = len(ids)
    seq.prefix_offset = max(seq.read_offset - _WINDOW, 0)
    return new_text


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
