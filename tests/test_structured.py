"""Structured outputs (flashdraft/structured/): grammar masks at every row that chooses a token, exact
under speculation. The reference is plain decoding of the same constrained request: the masks of a
verify row must be the ones plain decoding applies at that position, so speculation on and off give the
same tokens (float32 CPU, the shipped drafter's chains)."""

import json
import re

import jsonschema
import pytest
import torch

from flashdraft import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
QUESTIONS = ["Describe a person called Ada as JSON.", "Give me a JSON object for a user named Bob, aged 31.",
             "Write a JSON record of a 7 year old child.", "Output a JSON person."]


@pytest.fixture(scope="module")
def spec():
    return LLM(device="cpu", dtype="float32")  # the shipped drafter (chains in the suite)


@pytest.fixture(params=[True, False], ids=["checked", "masked"])
def check(request, monkeypatch):
    """Greedy constrained requests verified unmasked and checked before the commit
    (speculative/grammar_check.py), or masked at every verify row (FLASHDRAFT_GRAMMAR_CHECK=0)."""
    from flashdraft import settings

    monkeypatch.setattr(settings, "GRAMMAR_CHECK", request.param)
    return request.param


def _prompts(llm, qs=QUESTIONS):
    return [llm.engine.apply_chat_template([{"role": "user", "content": q}]) for q in qs]


def test_json_schema_is_lossless_under_speculation(smollm2, spec, check):
    so = StructuredOutputsParams(json=SCHEMA)
    params = SamplingParams(max_tokens=48, structured_outputs=so)
    prompts = _prompts(spec)
    want = smollm2.generate(prompts, params)
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert spec.engine.spec_totals()["num_drafts"] > 0
    for o in got:
        if o.finish_reason == "stop":
            jsonschema.validate(json.loads(o.text), SCHEMA)
    assert any(o.finish_reason == "stop" for o in got)


def test_batched_beside_unconstrained_and_seeded(smollm2, spec, check):
    """Constrained greedy and seeded sampled requests beside unconstrained ones: each equals plain decoding."""
    prompts = _prompts(spec) * 2
    params = [SamplingParams(max_tokens=40, structured_outputs=StructuredOutputsParams(json_object=True)),
              SamplingParams(max_tokens=40),
              SamplingParams(max_tokens=40, temperature=1.0, seed=7,
                             structured_outputs=StructuredOutputsParams(json=SCHEMA)),
              SamplingParams(max_tokens=40, temperature=1.0, seed=8)] * 2
    want = [o.token_ids for o in smollm2.generate(prompts, params)]
    assert [o.token_ids for o in spec.generate(prompts, params)] == want


def test_regex_and_choice(smollm2, spec):
    prompts = _prompts(spec, ["What is 6 times 7?", "Is the sky blue? Answer yes or no."])
    params = [SamplingParams(max_tokens=12, structured_outputs=StructuredOutputsParams(regex=r"[0-9]{1,3}")),
              SamplingParams(max_tokens=12, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))]
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in smollm2.generate(prompts, params)]
    assert re.fullmatch(r"[0-9]{1,3}", got[0].text) and got[1].text in ("yes", "no")


def test_the_mask_of_a_verify_row_follows_its_drafts(smollm2, spec, monkeypatch):
    """A mask taken at the committed state for every verify row (the drafts before the row not walked)
    gives other tokens than plain decoding: the test above would catch a mask at the wrong position."""
    import flashdraft.structured.masks as masks
    from flashdraft import settings

    monkeypatch.setattr(settings, "GRAMMAR_CHECK", False)  # (every verify row masked)
    real = masks.apply_grammars
    monkeypatch.setattr(masks, "apply_grammars", lambda logits, seqs, rows, seen: real(logits, seqs, rows, None))
    monkeypatch.setattr("flashdraft.engine.logits.apply_grammars", masks.apply_grammars)
    params = SamplingParams(max_tokens=48, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    prompts = _prompts(spec)
    want = [o.token_ids for o in smollm2.generate(prompts, params)]
    got = spec.generate(prompts, params)
    # a token the grammar forbids reached a commit (that request ends, "error"), or other tokens were chosen
    assert [o.token_ids for o in got] != want
    assert all(o.error is None for o in got if o.finish_reason != "error")


def test_a_failing_grammar_ends_only_its_request(smollm2, spec, monkeypatch, check):
    """A matcher that fails while its mask is filled ends its request ("error", with the reason); the
    constrained and unconstrained requests beside it give plain decoding's tokens."""
    from flashdraft.structured.grammar import RequestGrammar

    real = RequestGrammar.__init__

    def init(self, compiled, vocab_size):
        real(self, compiled, vocab_size)
        if compiled is failing[0]:  # (the regex request's matcher)
            self.matcher = _Failing(self.matcher)

    failing = [spec.engine.grammars()._compiled("regex", "[a-z]{1,40}", "regex")]
    monkeypatch.setattr(RequestGrammar, "__init__", init)
    prompts = _prompts(spec)[:3]
    params = [SamplingParams(max_tokens=24, structured_outputs=StructuredOutputsParams(regex="[a-z]{1,40}")),
              SamplingParams(max_tokens=24, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
              SamplingParams(max_tokens=24)]
    got = spec.generate(prompts, params)
    assert got[0].finish_reason == "error" and "the grammar failed: matcher broke" in got[0].error
    monkeypatch.undo()
    want = smollm2.generate(prompts[1:], params[1:])
    assert [o.token_ids for o in got[1:]] == [o.token_ids for o in want]


class _Failing:
    """A matcher that fails after its first three tokens, at its next mask or token."""

    def __init__(self, m):
        self.m, self.taken = m, 0

    def __getattr__(self, name):
        return getattr(self.m, name)

    def accept_token(self, t):
        if self.taken >= 3:
            raise RuntimeError("matcher broke")
        self.taken += 1
        return self.m.accept_token(t)

    def rollback(self, n):
        self.taken -= n
        return self.m.rollback(n)

    def fill_next_token_bitmask(self, mask, k):
        if self.taken >= 3:
            raise RuntimeError("matcher broke")
        return self.m.fill_next_token_bitmask(mask, k)


@pytest.mark.parametrize("so, match", [
    (dict(json="{not json"), "structured_outputs.json does not compile"),
    (dict(regex="(unclosed"), "structured_outputs.regex does not compile"),
    (dict(grammar="root ::= undefined_rule"), "structured_outputs.grammar does not compile"),
])
def test_bad_constraints_are_refused_before_queueing(spec, so, match):
    running = spec.engine.scheduler.has_unfinished()
    with pytest.raises(ValueError, match=match):
        spec.engine.add_request([1, 2, 3], SamplingParams(structured_outputs=StructuredOutputsParams(**so)))
    assert spec.engine.scheduler.has_unfinished() == running


def test_structured_outputs_params_takes_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        StructuredOutputsParams(choice=[])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_token_trees_are_lossless_for_constrained_requests(smollm2, monkeypatch, temperature):
    """On an engine that verifies token trees, each tree row's mask follows its own ancestors' drafts:
    constrained requests (JSON schema, regex) beside an unconstrained one give plain decoding's tokens,
    greedy and seeded, and the constrained ones verify trees."""
    from flashdraft import settings

    monkeypatch.setattr(settings, "CPU_TREE", True)
    llm = LLM(device="cpu", dtype="float32")
    assert llm.engine.spec.trees is not None
    prompts = _prompts(llm)[:3]
    seed = dict(seed=11) if temperature else {}
    params = [SamplingParams(max_tokens=40, temperature=temperature, structured_outputs=StructuredOutputsParams(
                  json=SCHEMA), **seed),
              SamplingParams(max_tokens=40, temperature=temperature, **seed),
              SamplingParams(max_tokens=24, temperature=temperature, structured_outputs=StructuredOutputsParams(
                  regex=r"[A-Z][a-z]{2,9}( [a-z]{2,9}){0,5}\\."), **seed)]
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in smollm2.generate(prompts, params)]
    assert outs[0].metrics["num_drafts"] > 0 and outs[2].metrics["num_drafts"] > 0


def test_a_draft_path_through_the_stop_token(smollm2, monkeypatch):
    """Forced tool calls on token trees, whose paths run on past the call's end and the stop token: the rows
    past it take no mask (the finished matcher has none) and are never committed; plain decoding's tokens,
    each request ending "stop" (the mask of such a row used to fail its request)."""
    from flashdraft import settings
    from flashdraft.bench.command import tokenize
    from flashdraft.bench.datasets import load_prompts

    monkeypatch.setattr(settings, "CPU_TREE", True)
    llm = LLM(device="cpu", dtype="float32")
    kept, ids, _ = tokenize(llm.engine, load_prompts("structured", 6), True, 64)
    pick = [i for i, p in enumerate(kept) if p.tools]
    params = [SamplingParams(max_tokens=64, structured_outputs=StructuredOutputsParams(**kept[i].constraint))
              for i in pick]
    outs = [llm.generate([ids[i]], p)[0] for i, p in zip(pick, params)]  # (one at a time, as at c = 1)
    assert [o.finish_reason for o in outs] == ["stop"] * len(pick), [o.error for o in outs]
    want = [o.token_ids for o in smollm2.generate([ids[i] for i in pick], params)]
    assert [o.token_ids for o in outs] == want and all(o.metrics["num_drafts"] > 0 for o in outs)


def test_the_server_takes_every_spelling(spec, smollm2):
    """Through a real server and the official openai client, on the shipped pair: response_format
    json_schema (answers that validate), vLLM's guided_choice and structured_outputs, SGLang's regex; each
    the tokens of plain decoding of the same constraint offline; a bad schema is a 400 naming the field."""
    import openai
    from fixtures import Served

    from flashdraft.server.app import build_app

    served = Served(build_app(spec.engine))
    try:
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        msgs = [{"role": "user", "content": QUESTIONS[1]}]
        r = client.chat.completions.create(model=client.models.list().data[0].id, messages=msgs, max_tokens=48,
                                           temperature=0, response_format={"type": "json_schema", "json_schema": {
                                               "name": "person", "schema": SCHEMA, "strict": True}})
        want = smollm2.chat([msgs], SamplingParams(max_tokens=48, structured_outputs=StructuredOutputsParams(
            json=SCHEMA)))[0]
        assert r.choices[0].message.content == want.text
        if r.choices[0].finish_reason == "stop":
            jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
        model = r.model
        for extra, check in ((dict(guided_choice=["yes", "no"]), lambda t: t in ("yes", "no")),
                             (dict(structured_outputs={"regex": "[0-9]+"}), lambda t: re.fullmatch("[0-9]+", t)),
                             (dict(regex="(red|green|blue)"), lambda t: t in ("red", "green", "blue")),
                             (dict(structural_tag=json.dumps({"type": "structural_tag", "format": {
                                 "type": "sequence", "elements": [{"type": "const_string", "value": "Answer: "},
                                                                  {"type": "regex", "pattern": "[0-9]{2}"}]}})),
                              lambda t: re.fullmatch("Answer: [0-9]{2}", t))):
            r = client.completions.create(model=model, prompt="The answer:", max_tokens=8, temperature=0,
                                          extra_body=extra)
            assert check(r.choices[0].text), (extra, r.choices[0].text)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, messages=msgs, max_tokens=4, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}})
        assert e.value.body["param"] == "response_format"
    finally:
        served.close()


def test_a_finished_grammar_ends_its_request_even_with_ignore_eos(spec):
    """Once the grammar has taken its stop token nothing may follow: the request ends there ("stop"),
    ignore_eos or not, instead of asking the finished grammar for another mask."""
    prompt = _prompts(spec, ["Is the sky blue? Answer yes or no."])
    out = spec.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True,
                                               structured_outputs=StructuredOutputsParams(choice=["yes", "no"])))[0]
    assert out.finish_reason == "stop" and out.text in ("yes", "no")


def test_guided_decoding_is_the_earlier_name():
    from flashdraft import GuidedDecodingParams

    p = SamplingParams(guided_decoding=GuidedDecodingParams(choice=["a", "b"]))
    assert p.structured_outputs == StructuredOutputsParams(choice=["a", "b"]) and p.guided_decoding is None
    with pytest.raises(ValueError, match="not both"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"),
                       guided_decoding=GuidedDecodingParams(regex="b"))


def test_the_walk_takes_each_slot_s_first_allowed_candidate(spec):
    """walk_drafts against a step-by-step reference on a second matcher: each slot's draft is its first
    candidate the grammar allows after the drafts before it, the walk ends at a slot with none, every
    kept mask is the one filled after that prefix, and the matcher ends where it started."""
    import xgrammar as xgr

    from flashdraft.structured.walk import walk_drafts

    tok, grammars = spec.engine.tokenizer, spec.engine.grammars()
    ids = {c: tok.convert_tokens_to_ids(c) for c in "123-ab"}
    so = StructuredOutputsParams(regex="[0-9]{2}-[a-z]+")
    g, ref = grammars.request(so), grammars.request(so)
    before = xgr.allocate_token_bitmask(1, g.vocab_size)
    g.matcher.fill_next_token_bitmask(before)
    cands = [[ids["a"], ids["1"]], [ids["2"]], [ids["-"], ids["3"]], [ids["1"], ids["-"]], [ids["b"]]]
    drafts = walk_drafts([g], [cands])[0]
    assert drafts == [ids["1"], ids["2"], ids["-"], ids["1"], ids["b"]]  # slot 3: no candidate allowed
    look = g.lookahead
    assert look.tokens == drafts[:3] and look.refused == ids["1"] and look.masks.shape[0] == 4
    for n in range(4):  # the mask after each prefix, filled on the reference matcher
        want = xgr.allocate_token_bitmask(1, g.vocab_size)
        ref.matcher.fill_next_token_bitmask(want)
        assert torch.equal(look.masks[n], want[0])
        if n < 3:
            assert ref.matcher.accept_token(drafts[n])
    assert look.mask(drafts[:2]) is look.masks[2] or torch.equal(look.mask(drafts[:2]), look.masks[2])
    assert torch.equal(look.mask(drafts), look.masks[3]) and look.mask([ids["2"]]) is None
    after = xgr.allocate_token_bitmask(1, g.vocab_size)
    g.matcher.fill_next_token_bitmask(after)
    assert torch.equal(before, after)


def test_walked_drafts_raise_acceptance_and_change_no_token(smollm2, spec, monkeypatch):
    """Constrained chains with their drafts walked through the grammar and without: both give plain
    decoding's tokens (greedy and seeded, beside an unconstrained request), the walked ones accept more
    drafts, and their verify rows take the walk's masks (the step's own fills: its plain rows alone)."""
    import flashdraft.structured.masks as masks
    from flashdraft import settings

    monkeypatch.setattr(settings, "GRAMMAR_CHECK", False)  # (the greedy request's drafts walked too)
    filled = []
    real = masks.fill_masks
    monkeypatch.setattr(masks, "fill_masks", lambda gs, mask, rows: (filled.append(len(rows)), real(gs, mask, rows)))
    prompts = _prompts(spec)[:3]
    params = [SamplingParams(max_tokens=40, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
              SamplingParams(max_tokens=40, temperature=1.0, seed=3,
                             structured_outputs=StructuredOutputsParams(json=SCHEMA)),
              SamplingParams(max_tokens=40)]
    want = [o.token_ids for o in smollm2.generate(prompts, params)]
    runs = {}
    for walk in (False, True):
        monkeypatch.setattr(settings, "GRAMMAR_DRAFTS", walk)
        filled.clear()
        t0 = spec.engine.spec_totals()
        assert [o.token_ids for o in spec.generate(prompts, params)] == want
        t1 = spec.engine.spec_totals()
        blocks = t1["num_drafts"] - t0["num_drafts"]
        runs[walk] = (t1["num_accepted_tokens"] - t0["num_accepted_tokens"]) / blocks, sum(filled)
    assert runs[True][0] > runs[False][0], runs
    assert runs[True][1] < runs[False][1] / 4, runs  # (unwalked: every verify row filled at the verify)


def test_properties_come_in_the_schema_s_order(smollm2):
    """The grammar asks for a schema's properties in the order it lists them (xgrammar's rule, as vLLM
    serves it), not sorted: the compiled-grammar cache keys the schema as given."""
    schema = {"type": "object", "properties": {"zone": {"type": "integer"}, "area": {"type": "integer"}},
              "required": ["zone", "area"], "additionalProperties": False}
    so = StructuredOutputsParams(json=schema)
    out = smollm2.generate(_prompts(smollm2, ["Give a zone and an area as JSON."]),
                           SamplingParams(max_tokens=40, structured_outputs=so))[0]
    assert out.finish_reason == "stop"
    assert [k for k, _ in json.loads(out.text, object_pairs_hook=list)] == ["zone", "area"]


def test_constrained_decode_steps_launch_ahead():
    """A constrained request's decode step after one in flight is launched before that step is read; its
    mask is filled once the step before it is committed (engine/deferred.py). Plain and DFlash engines
    (every step without drafts: speculative_disable_batch_size=1) give the step-by-step engine's tokens,
    greedy and seeded, beside an unconstrained request, and do overlap."""
    sync = LLM(device="cpu", dtype="float32", draft=None, async_scheduling=False)
    ahead = LLM(device="cpu", dtype="float32", draft=None, async_scheduling=True)
    paused = LLM(device="cpu", dtype="float32", speculative_disable_batch_size=1, async_scheduling=True)
    prompts = _prompts(sync)[:3]
    params = [SamplingParams(max_tokens=32, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
              SamplingParams(max_tokens=32, temperature=1.0, seed=5,
                             structured_outputs=StructuredOutputsParams(json_object=True)),
              SamplingParams(max_tokens=32)]
    want = [o.token_ids for o in sync.generate(prompts, params)]
    for llm in (ahead, paused):
        before = llm.engine.stats["num_overlapped_steps"]
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
        assert llm.engine.stats["num_overlapped_steps"] - before > 10


def test_checked_tokens_are_plain_decodings(smollm2, spec, monkeypatch):
    """Greedy JSON-schema requests verified unmasked (speculative/grammar_check.py): the check replaces
    tokens the grammar forbids (it had to, here) and gives plain decoding's tokens. Without the check, or
    with each replacement taken from the row before its own, the tokens differ (or a forbidden token
    reaches a commit: "error")."""
    import flashdraft.speculative.dflash as dflash
    import flashdraft.speculative.grammar_check as gc
    from flashdraft import settings

    monkeypatch.setattr(settings, "GRAMMAR_CHECK", True)
    params = SamplingParams(max_tokens=48, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    prompts = _prompts(spec)
    want = [o.token_ids for o in smollm2.generate(prompts, params)]
    fixed = []
    real_greedy = gc.greedy_tokens
    monkeypatch.setattr(gc, "greedy_tokens", lambda logits: (fixed.append(logits.shape[0]), real_greedy(logits))[1])
    assert [o.token_ids for o in spec.generate(prompts, params)] == want
    assert sum(fixed) > 0  # (rows whose unmasked token the grammar forbade)
    real = gc.check_outcome  # each replacement from the row before its own
    monkeypatch.setattr(dflash, "check_outcome", lambda model, plans, out, hidden: real(
        model, plans, out, torch.roll(hidden, 1, 0)))
    assert [o.token_ids for o in spec.generate(prompts, params)] != want
    monkeypatch.setattr(dflash, "check_outcome", lambda model, plans, out, hidden: out)
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] != want or any(o.finish_reason == "error" for o in got)
