"""A reasoning model's thinking apart from its answer (vLLM's `--reasoning-parser`, `reasoning_content`):

    qwen3        <think> ... </think> then the answer; no <think> at the start: all answer (the
                 template's enable_thinking=False writes an empty block into the prompt)
    deepseek_r1  the response opens in reasoning (its template ends the prompt with <think>)

A prompt that ends with the opening tag starts its response in reasoning, whatever the parser. Text that
streams is split as it comes: a piece that may begin the closing tag waits for the next."""

from __future__ import annotations

from dataclasses import dataclass

from flashdraft.chat.tool_calls import by_name, partial_suffix


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    opens: bool = False  # the response starts in reasoning


PARSERS = {"qwen3": ReasoningFormat("qwen3"), "deepseek_r1": ReasoningFormat("deepseek_r1", opens=True)}
REFUSED = {"gpt_oss": "GPT-OSS's analysis channel (harmony)", "openai_gptoss": "GPT-OSS's analysis channel (harmony)"}


def reasoning_format(name: str) -> ReasoningFormat:
    return by_name("reasoning parser", PARSERS, REFUSED, name)


PRE, REASONING, ANSWER_START, ANSWER = range(4)


class ReasoningStream:
    """Splits a response's text, piece by piece, into reasoning and answer."""

    def __init__(self, fmt: ReasoningFormat, prompt_opened: bool = False):
        self.fmt = fmt
        self.state = REASONING if fmt.opens or prompt_opened else PRE
        self.buf = ""
        self.started = False  # reasoning: its leading whitespace dropped
        self.entered = self.state == REASONING  # the response has a reasoning block

    @property
    def reasoning_open(self) -> bool:
        """Whether the response is (or may yet be) in its reasoning."""
        return self.state in (PRE, REASONING)

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) this piece adds."""
        self.buf += text
        reasoning = answer = ""
        while True:
            if self.state == PRE:
                rest = self.buf.lstrip()
                if not rest or (self.fmt.start.startswith(rest) and rest != self.fmt.start):
                    break
                if rest.startswith(self.fmt.start):
                    self.buf, self.state, self.entered = rest[len(self.fmt.start):], REASONING, True
                else:
                    self.state = ANSWER
                continue
            if self.state == REASONING:
                if not self.started:
                    self.buf = self.buf.lstrip()
                    if not self.buf:
                        break
                    self.buf, self.started = self.buf.removeprefix(self.fmt.start).lstrip(), True
                at = self.buf.find(self.fmt.end)
                if at < 0:
                    keep = partial_suffix(self.buf, self.fmt.end)
                    reasoning += self.buf[: len(self.buf) - keep]
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                reasoning += self.buf[:at]
                self.buf, self.state = self.buf[at + len(self.fmt.end):], ANSWER_START
                continue
            if self.state == ANSWER_START:
                self.buf = self.buf.lstrip()
                if not self.buf:
                    break
                self.state = ANSWER
            answer += self.buf
            self.buf = ""
            break
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """What was held back: reasoning when the response ended in it, else answer."""
        rest, self.buf = self.buf, ""
        return (rest, "") if self.state == REASONING else ("", rest if self.state != ANSWER_START else "")


def split_reasoning(text: str, fmt: ReasoningFormat, prompt_opened: bool = False) -> tuple[str | None, str]:
    """A whole response's (reasoning, answer); reasoning None when the response has none."""
    stream = ReasoningStream(fmt, prompt_opened)
    r1, a1 = stream.feed(text)
    r2, a2 = stream.finish()
    return (r1 + r2 if stream.entered else None), a1 + a2


def prompt_opens_reasoning(prompt_text: str, fmt: ReasoningFormat) -> bool:
    """Whether a rendered prompt leaves its response inside a reasoning block (its last tag the opening one)."""
    return prompt_text.rstrip().endswith(fmt.start)
