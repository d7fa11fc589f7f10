"""Structured output on the reference engine: a request's grammar (`StructuredOutput`) as a
per-token mask over the model's logits, through llguidance (the library vLLM's `guidance`
backend uses, with the same grammar construction, so a request constrains output alike).

`GrammarVocab` is the engine's vocabulary as llguidance sees it, built once per engine (a
large `tokenizer.json` takes about a second). `TokenConstraint` follows one sequence: `mask_`
before each draw, `accept` after it. EOS is allowed exactly where the grammar may end, and
`done` says the grammar can take nothing more, so the engine stops as it would on EOS. Ids
the tokenizer does not have (a model's padded vocabulary) are never allowed.

Compiling is the slow part for big schemas, so each vocabulary keeps its last few compiled
grammars in their start state; a request gets a deep copy (microseconds).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path
from typing import Any

import llguidance
import numpy as np
import torch

from prfaas.common.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from prfaas.protocol.errors import invalid
from prfaas.protocol.structured_output import StructuredOutput

COMPILED_CACHE = 32
"""Compiled grammars each vocabulary keeps (least recently used dropped first)."""
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)  # errors go to clients: no dumps
_WHAT = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


class GrammarVocab:
    """An engine's tokenizer for llguidance, with the model's vocabulary size (which may
    exceed the tokenizer's) and a small cache of compiled grammars (compile from one thread:
    the cache takes no lock)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        """The model's vocabulary: the length of the logits a constraint masks."""
        self.eos_token_id = tokenizer.eos_token_id
        self.ll_tokenizer = _ll_tokenizer(tokenizer)
        self.tokenizer_size = self.ll_tokenizer.vocab_size
        """Ids the tokenizer has; ids from here to `vocab_size` are never allowed."""
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    def _start(self, grammar: str) -> llguidance.LLMatcher:
        """A matcher for llguidance grammar `grammar` in its start state (possibly in an
        error state: check `is_error()`)."""
        template = self._compiled.get(grammar)
        if template is None:
            template = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=_LIMITS)
            if template.is_error():
                return template
            self._compiled[grammar] = template
            if len(self._compiled) > COMPILED_CACHE:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(grammar)
        return template.deep_copy()


class _ByteTokens:
    """`ByteTokenizer` in the shape `llguidance.TokenizerWrapper` reads: each id's bytes
    (specials marked with llguidance's 0xFF prefix, so no text can spell them)."""

    def __init__(self, tokenizer: ByteTokenizer) -> None:
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = [bytes([i]) for i in range(256)]
        self.tokens += [b"\xff<special_%d>" % i for i in range(256, tokenizer.vocab_size)]
        self.special_token_ids = list(range(256, tokenizer.vocab_size))

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def _ll_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    if isinstance(tokenizer, ByteTokenizer):
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokens(tokenizer)))
    if isinstance(tokenizer, HFTokenizer):
        from tokenizers import Tokenizer as RustTokenizer

        # The checkpoint's tokenizer.json plus the special tokens HFTokenizer adds from its
        # config (same tokens, same order: same ids).
        rust = RustTokenizer.from_file(str(Path(tokenizer.name) / "tokenizer.json"))
        rust.add_special_tokens(list(tokenizer.template_variables().values()))
        return llguidance.LLTokenizer(rust.to_str(), eos_token=tokenizer.eos_token_id)
    raise TypeError(f"no llguidance vocabulary for tokenizer {type(tokenizer).__name__}")


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
"""Keys whose value maps names to schemas (the map itself is not a schema)."""


def _closed(schema: Any) -> Any:
    """`schema` with every object that lists its `properties` closed to others unless it
    says otherwise, as vLLM's default (xgrammar, strict) and its guidance backend's
    `disable_additional_properties` read a schema: a model fills the keys asked for."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {
        k: {n: _closed(v) for n, v in val.items()}
        if k in _SCHEMA_MAPS and isinstance(val, dict) else _closed(val)
        for k, val in schema.items()
    }  # fmt: skip
    if "properties" in schema and "additionalProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


def _grammar(spec: StructuredOutput) -> str:
    """The llguidance grammar of `spec`, as vLLM's guidance backend builds it with
    `disable_any_whitespace` (JSON with llguidance's fixed separators: no model, however
    random, pads a document past its token budget with whitespace); `grammar` is Lark, or
    GBNF converted to Lark.

    Raises:
        ValueError: the grammar text cannot be read.
    """
    if spec.kind == "json":
        schema = {"type": "object"} if spec.spec is None else _closed(spec.spec)
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}
        )
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.spec)
    if spec.kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(list(spec.spec)))
    return llguidance.grammar_from("grammar", spec.spec)


class TokenConstraint:
    """One sequence's grammar: which token ids may come next, advanced token by token."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab: GrammarVocab) -> None:
        self._matcher = matcher
        self._vocab = vocab

    @classmethod
    def compile(
        cls, spec: StructuredOutput, vocab: GrammarVocab, param: str | None = None
    ) -> TokenConstraint:
        """`spec` compiled for `vocab`, at the start of the output.

        Raises:
            APIError: 400 naming `param` (default: the parameter `spec` came from) when the
                schema, regex or grammar is invalid or unsupported.
        """
        name = param or spec.param
        try:
            matcher = vocab._start(_grammar(spec))
        except ValueError as exc:
            raise invalid(f"invalid {_WHAT[spec.kind]}: {exc}", name) from None
        except RecursionError:
            raise invalid(f"the {_WHAT[spec.kind]} is nested too deeply", name) from None
        if matcher.is_error():
            raise invalid(f"invalid {_WHAT[spec.kind]}: {matcher.get_error().strip()}", name)
        return cls(matcher, vocab)

    def fork(self) -> TokenConstraint:
        """An independent copy in the same state (another sequence of the same request)."""
        return TokenConstraint(self._matcher.deep_copy(), self._vocab)

    def mask_(self, logits: torch.Tensor) -> None:
        """Set the logits of the ids the grammar forbids next to -inf, in place (`logits`:
        1-D, the model's vocabulary)."""
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little").view(bool)
        known = min(self._vocab.tokenizer_size, logits.numel())
        forbidden = torch.from_numpy(~allowed[:known]).to(logits.device, non_blocking=True)
        logits[:known].masked_fill_(forbidden, float("-inf"))
        logits[known:] = float("-inf")

    def accept(self, token: int) -> None:
        """Advance past `token`.

        Raises:
            ValueError: the grammar does not allow `token` here (the state is unchanged).
        """
        known = 0 <= token < self._vocab.tokenizer_size
        if not known or self._matcher.try_consume_tokens([token]) != 1:
            raise ValueError(f"token {token} is not allowed by the output grammar here")

    @property
    def done(self) -> bool:
        """The grammar is complete and nothing may follow (EOS aside): stop as on EOS."""
        return self._matcher.is_stopped()
