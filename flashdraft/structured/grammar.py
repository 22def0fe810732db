"""Grammars of requests, on xgrammar: compiled once per distinct constraint against the target's
tokenizer (cached), and one matcher per request that follows its committed output.

xgrammar rather than llguidance: both take JSON schema, regex and EBNF and roll a matcher back by a count
of tokens, which the verify rows need; xgrammar fills a mask into a torch bitmask and applies it to logits
in place on the CPU and on CUDA, and vLLM and SGLang default to it for the same families."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

import torch

from flashdraft.sampling_params import StructuredOutputsParams


@dataclass
class Lookahead:
    """What one walk left for its request's verify rows: the drafts its matcher took (`tokens`), the slot's
    draft where the walk ended on a token its grammar forbids (`refused`, else None), the mask after
    each prefix of `tokens` ([len(tokens) + 1, W] int32), and every draft the verify is fed (`drafts`: the
    walked ones, then the drafter's own), so that its rows' paths are known without reading the device."""

    tokens: list[int]
    refused: int | None
    masks: torch.Tensor
    drafts: list[int]

    def mask(self, path: list[int]) -> torch.Tensor | None:
        """The mask of the verify row after the drafts `path`, when the walk filled it: a prefix of the
        walked drafts, or those drafts and then the refused one (the row's grammar stops at it)."""
        n = len(self.tokens)
        if path[:n] == self.tokens[: len(path)]:
            if len(path) <= n:
                return self.masks[len(path)]
            if self.refused is not None and path[n] == self.refused:
                return self.masks[n]
        return None


class RequestGrammar:
    """One request's matcher: its state is the grammar after the request's committed output."""

    def __init__(self, compiled, vocab_size: int):
        import xgrammar as xgr

        self.vocab_size = vocab_size  # the width of its masks: the target's vocabulary
        self.matcher = xgr.GrammarMatcher(compiled)  # (its rollback reaches any number of tokens)
        self.error: str | None = None  # the matcher failed: the request ends ("error"), no other one
        self.mask_s = 0.0  # host time of its masks (its share of each step's), a request metric
        self.lookahead: Lookahead | None = None  # the masks its drafts' walk filled (walk.py), until a commit

    @property
    def done(self) -> bool:
        """Whether the grammar has taken its stop token (nothing may follow), or failed."""
        return self.error is not None or self.matcher.is_terminated()

    def commit(self, token: int) -> None:
        """Advance past a committed token; a token the mask allowed is always accepted (one it did not
        fails this request's grammar)."""
        self.lookahead = None
        if self.done:
            return
        try:
            ok = self.matcher.accept_token(token)
        except Exception as e:  # (xgrammar's own failure: this request's, not the step's)
            self.fail(f"the grammar failed: {e}")
            return
        if not ok:
            self.fail(f"token {token} was committed against its request's grammar")

    def fail(self, message: str) -> None:
        if self.error is None:
            self.error = message


class Grammars:
    """The engine's grammar compiler over its tokenizer, with a cache of compiled constraints."""

    def __init__(self, tokenizer, vocab_size: int):
        try:  # (imported when a request first asks: it takes seconds to import)
            import xgrammar as xgr
        except ImportError:
            raise ValueError("structured_outputs needs the xgrammar package (pip install xgrammar)") from None
        try:
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        except Exception as e:  # a tokenizer xgrammar cannot map to bytes
            raise ValueError(f"structured_outputs: this tokenizer cannot be used by xgrammar: {e}") from None
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(info)
        self._compiled = lru_cache(maxsize=256)(self._compile)

    def request(self, spec: StructuredOutputsParams) -> RequestGrammar:
        """A matcher for a request; ValueError naming the constraint when it does not compile."""
        if spec.json is not None:
            # (keys in the schema's order: the grammar asks for properties in the order the schema lists them)
            key = ("json", spec.json if isinstance(spec.json, str) else json.dumps(spec.json), "json")
        elif spec.json_object:
            key = ("json_object", "", "json_object")
        elif spec.regex is not None:
            key = ("regex", spec.regex, "regex")
        elif spec.structural_tag is not None:
            tag = spec.structural_tag
            key = ("structural_tag", tag if isinstance(tag, str) else json.dumps(tag), "structural_tag")
        elif spec.choice is not None:  # the alternatives as an EBNF grammar of JSON-escaped literals
            key = ("grammar", "root ::= " + " | ".join(json.dumps(c) for c in spec.choice), "choice")
        else:
            key = ("grammar", spec.grammar, "grammar")
        return RequestGrammar(self._compiled(*key), self.vocab_size)

    def _compile(self, kind: str, text: str, name: str):
        try:
            if kind == "json":
                json.loads(text)  # (xgrammar's own message for bad JSON names no field)
                return self.compiler.compile_json_schema(text)
            if kind == "json_object":
                return self.compiler.compile_builtin_json_grammar()
            if kind == "structural_tag":
                json.loads(text)
                return self.compiler.compile_structural_tag(text)
            if kind == "regex":
                return self.compiler.compile_regex(text)
            return self.compiler.compile_grammar(text)
        except Exception as e:
            raise ValueError(f"structured_outputs.{name} does not compile: {e}") from None
