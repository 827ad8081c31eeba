"""How a rerank model's input is built and batched: pure functions, no llama.cpp.

A reranker scores one (query, document) pair per sequence: its input is the pair's tokens, and
llama.cpp's rank pooling turns the sequence's hidden state into its score (the first float of
the pooled output: a BERT-style classifier's logit, or a Qwen3 reranker's "yes" probability).
The pair is laid out as llama.cpp's own server does (``format_prompt_rerank``): the model's
``tokenizer.chat_template.rerank`` with ``{query}`` and ``{document}`` replaced, when it has
one; otherwise ``[BOS] query [EOS] [SEP] document [EOS]``, each added token only where the
vocabulary says to add it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from residency.errors import ApiError

#: ``tokenize(text, special)``: the text's tokens with nothing added (no BOS/EOS); ``special``
#: parses control-token text (``<|im_start|>``…) as those tokens.
Tokenize = Callable[[str, bool], list[int]]


@dataclass(frozen=True)
class PairFormat:
    template: str | None = None  # the model's rerank template, if any
    bos: int | None = None  # each None: not added
    eos: int | None = None
    sep: int | None = None


def pair_tokens(fmt: PairFormat, tokenize: Tokenize, query: str, document: str) -> list[int]:
    if fmt.template is not None:
        prompt = fmt.template.replace("{query}", query).replace("{document}", document)
        return tokenize(prompt, True)
    out: list[int] = []
    if fmt.bos is not None:
        out.append(fmt.bos)
    out += tokenize(query, False)
    if fmt.eos is not None:
        out.append(fmt.eos)
    if fmt.sep is not None:
        out.append(fmt.sep)
    out += tokenize(document, False)
    if fmt.eos is not None:
        out.append(fmt.eos)
    return out


def check_lengths(lengths: list[int], cap: int) -> None:
    """400 naming the first document whose pair does not fit in one batch: a pooled sequence
    must be decoded whole."""
    for i, n in enumerate(lengths):
        if n > cap:
            raise ApiError(
                400,
                f"The query with document {i} is {n} tokens; this rerank model takes at most "
                f"{cap} per pair. Shorten the query or the document.",
                param=f"documents[{i}]",
                code="context_length_exceeded",
            )


def batches(lengths: list[int], max_tokens: int, max_seqs: int) -> list[list[int]]:
    """The pairs (by index, in order) decoded together: as many as fit in ``max_tokens``
    tokens and ``max_seqs`` sequences. Every length must be at most ``max_tokens``."""
    out: list[list[int]] = []
    group: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if group and (used + n > max_tokens or len(group) >= max_seqs):
            out.append(group)
            group, used = [], 0
        group.append(i)
        used += n
    if group:
        out.append(group)
    return out
