"""The vLLM proposers (``hf_paralleldecode.serving.vllm``) driven as vLLM's ``custom_class`` hook drives them: per
step, the tokens sampled per batch slot, each slot's token count and a ``[slots, max_model_len]`` token array; slots
reordered as requests finish, are preempted and join. vLLM itself runs them in ``scripts/vllm-check.sh``."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from hf_paralleldecode.decoding.prompt_lookup import NgramIndex
from hf_paralleldecode.serving.requests import RequestStates
from hf_paralleldecode.serving.vllm import ContextProposer


def _config(k=6, max_model_len=256):
    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k),
                           model_config=SimpleNamespace(max_model_len=max_model_len, model="unused"))


def _stream(seed: int, length: int) -> list[int]:
    """A token stream that repeats itself (what context n-grams find): phrases drawn from a small set."""
    rng = random.Random(seed)
    phrases = [[rng.randrange(50) for _ in range(rng.randrange(2, 6))] for _ in range(6)]
    out = []
    while len(out) < length:
        out += rng.choice(phrases) if rng.random() < 0.8 else [rng.randrange(50)]
    return out[:length]


class FakeEngine:
    """Requests as vLLM's batch holds them: a slot each, reshuffled every step; a preempted request goes back to the
    queue with its tokens and is re-admitted later; a finished one leaves. Each step commits 1-4 tokens of every
    running request's stream; a request admitted this step is still in prefill (nothing sampled: no draft)."""

    def __init__(self, proposer, streams: dict[str, list[int]], prompt_len: int = 12, seed: int = 0,
                 preempt: float = 0.1):
        self.proposer, self.streams, self.preempt = proposer, streams, preempt
        self.rng = random.Random(seed)
        self.count = dict.fromkeys(streams, prompt_len)
        self.waiting = list(streams)
        self.running: list[str] = []
        self.fresh: set[str] = set()

    def step(self) -> list[tuple[list[int], list[int], bool]]:
        """Per slot: the request's tokens, the draft proposed for it, whether it sampled a token this step."""
        for _ in range(2):
            if self.waiting:
                rid = self.waiting.pop(0)
                self.running.append(rid)
                self.fresh.add(rid)
        if len(self.running) > 1 and self.rng.random() < self.preempt:
            self.waiting.append(self.running.pop(self.rng.randrange(len(self.running))))
        self.rng.shuffle(self.running)
        slots = len(self.running) + 2  # spare slots hold stale rows, as vLLM's buffers do
        tokens = np.full((slots, self.proposer.max_model_len), 7, dtype=np.int32)
        counts = np.zeros(slots, dtype=np.int32)
        sampled = []
        for slot, rid in enumerate(self.running):
            if rid in self.fresh:  # its prefill: nothing sampled yet
                sampled.append([])
                self.fresh.discard(rid)
            else:
                n = min(self.count[rid] + self.rng.randrange(1, 5), len(self.streams[rid]))
                sampled.append(self.streams[rid][self.count[rid]:n])
                self.count[rid] = n
            tokens[slot, : self.count[rid]] = self.streams[rid][: self.count[rid]]
            counts[slot] = self.count[rid]
        drafts = self.proposer.propose(sampled, counts, tokens, slot_mappings=None)
        assert len(drafts) == len(sampled)
        rows = [(tokens[i, : counts[i]].tolist(), drafts[i], bool(sampled[i])) for i in range(len(sampled))]
        self.running = [r for r in self.running if self.count[r] < len(self.streams[r])]
        return rows

    def run(self, max_steps: int = 500) -> list:
        out = []
        while (self.running or self.waiting) and len(out) < max_steps:
            out.extend(self.step())
        return out


def _stateless(tokens: list[int], proposer) -> list[int]:
    """What the proposer must draft for these tokens: an index built afresh from them."""
    k = min(proposer.k, proposer.max_model_len - len(tokens))
    return NgramIndex(tokens, proposer.ngram_size).chain(k, proposer.max_matches)


class Uncapped(ContextProposer):
    max_requests = None


def test_context_proposer_keeps_each_requests_state_across_reordering_preemption_and_finish():
    proposer = Uncapped(_config())
    streams = {f"r{i}": _stream(i, 120) for i in range(7)}
    streams["twin"] = list(streams["r0"][:40]) + _stream(99, 80)  # shares r0's start, then diverges
    rows = FakeEngine(proposer, streams).run()
    drafted = [r for r in rows if r[2]]
    assert drafted and sum(bool(d) for _, d, _ in drafted) > len(drafted) // 2  # the streams repeat: most steps draft
    for tokens, draft, sampled in rows:
        assert draft == (_stateless(tokens, proposer) if sampled else [])
    for _ in range(proposer.max_idle_steps + 1):  # every request finished: their states go
        proposer.propose([], np.zeros(0, dtype=np.int32), np.zeros((0, 256), dtype=np.int32))
    assert len(proposer.requests) == 0


def test_context_proposer_reuses_the_state_and_feeds_only_new_tokens():
    proposer = ContextProposer(_config())
    stream = _stream(3, 100)
    tokens = np.array([stream], dtype=np.int32)
    for n in range(20, 100, 3):
        proposer.propose([[stream[n - 1]]], np.array([n]), tokens)
    assert proposer.requests.created == 1 and len(proposer.requests) == 1


def test_chain_is_the_path_most_continuations_share():
    # the suffix (1, 2) occurs three times: followed by 5 6 9, 5 6 8 and 4; "5 6" has two votes, then 9 vs 8 tie -> 9
    # (the most recent occurrence ranks first within a length)
    index = NgramIndex([1, 2, 5, 6, 8, 0, 1, 2, 4, 0, 1, 2, 5, 6, 9, 0, 1, 2], 2)
    assert index.candidates(3, 4)[:3] == [[5, 6, 9], [4, 0, 1], [5, 6, 8]]
    assert index.chain(3, 4) == [5, 6, 9]
    assert NgramIndex([1, 2, 3], 2).chain(3, 4) == []


def test_proposer_drafts_within_max_model_len_and_not_under_load():
    proposer = ContextProposer(_config(k=6, max_model_len=24))
    stream = [1, 2, 3, 4] * 6
    tokens = np.array([stream], dtype=np.int32)
    assert len(proposer.propose([[4]], np.array([20]), tokens)[0]) == 4  # 24 - 20 positions left
    assert proposer.propose([[4]], np.array([24]), tokens) == [[]]  # at the limit: nothing

    class Capped(ContextProposer):
        max_requests = 2

    capped = Capped(_config())
    many = np.array([[1, 2, 3, 1, 2, 3, 1, 2]] * 3, dtype=np.int32)
    assert capped.propose([[2]] * 3, np.array([8, 8, 8]), many) == [[], [], []]
    assert capped.propose([[2]] * 2, np.array([8, 8]), many[:2]) != [[], []]


@pytest.mark.parametrize("k", [0, None, "8"])
def test_proposer_refuses_a_config_without_speculative_tokens(k):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        ContextProposer(_config(k=k))


def test_request_states_drop_idle_and_excess_entries():
    states = RequestStates(lambda tokens: object(), max_idle_steps=2, max_entries=3)
    entries = [states.lookup(np.array([i, 1, 2])) for i in range(5)]
    assert len(states) == 5 and len({id(e) for e in entries}) == 5
    states.end_step()
    assert len(states) == 3  # the most recently used three
    states.end_step()
    states.end_step()
    assert len(states) == 0
    with pytest.raises(ValueError):
        RequestStates(lambda t: None, max_idle_steps=0)


def _deer_config(k=8, max_model_len=512):
    import hf_paralleldecode as hfpd

    path = hfpd.default_model_path("default")
    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k),
                           model_config=SimpleNamespace(max_model_len=max_model_len, model=str(path),
                                                        hf_config=SimpleNamespace(vocab_size=8192)))


@pytest.fixture(scope="module")
def greedy_streams():
    import torch

    import hf_paralleldecode as hfpd
    from hf_paralleldecode.prompts import read_prompts

    model, tok = hfpd.load_default_model("default")
    texts = read_prompts(Path(hfpd.__file__).parent / "assets" / "prompts" / "stdlib_test_midfile.jsonl")[:3]
    out = []
    for text in texts:
        ids = tok(text, return_tensors="pt")["input_ids"]
        seq = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=48,
                             decoding="stock")
        out.append((ids.shape[1], seq[0].tolist()))
    return out


def test_deer_proposer_drafts_as_a_fresh_drafter_would_and_is_accepted(greedy_streams):
    from hf_paralleldecode.serving.vllm import DeerProposer

    class Fp32Deer(DeerProposer):
        drafter_dtype = "float32"  # the comparison below is exact in fp32
        max_requests = None

    proposer, fresh = Fp32Deer(_deer_config()), Fp32Deer(_deer_config())
    # vLLM verifies greedily: a draft commits its prefix that matches the model's greedy text, then one more token
    counts = {i: prompt_len + 1 for i, (prompt_len, _) in enumerate(greedy_streams)}
    accepted, steps = 0, 0
    while any(counts[i] < len(s) for i, (_, s) in enumerate(greedy_streams)):
        live = [i for i, (_, s) in enumerate(greedy_streams) if counts[i] < len(s)]
        tokens = np.zeros((len(live), 512), dtype=np.int32)
        for slot, i in enumerate(live):
            tokens[slot, : counts[i]] = greedy_streams[i][1][: counts[i]]
        drafts = proposer.propose([[1]] * len(live), np.array([counts[i] for i in live]), tokens)
        for slot, i in enumerate(live):
            stream, n = greedy_streams[i][1], counts[i]
            entry = fresh.requests.lookup(np.asarray(stream[:n]), fresh=True)
            assert drafts[slot] == fresh.draft_rows([(entry, np.asarray(stream[:n]), min(8, 512 - n))])[0]
            ok = 0
            while ok < len(drafts[slot]) and n + ok < len(stream) and drafts[slot][ok] == stream[n + ok]:
                ok += 1
            accepted += ok
            steps += 1
            counts[i] = min(n + ok + 1, len(stream))
    assert proposer.requests.created == len(greedy_streams)  # one state per request, kept across steps
    assert 1 + accepted / steps > 2.0  # the shipped DEER drafter is accepted on its own model's text


def test_deer_proposer_refuses_what_it_cannot_draft_with():
    from hf_paralleldecode.serving.vllm import DeerProposer

    with pytest.raises(ValueError, match="block_size"):
        DeerProposer(_deer_config(k=64))

    class Head(DeerProposer):
        drafter = "default-jetspec"

    with pytest.raises(ValueError, match="export"):
        Head(_deer_config())
    bare = _deer_config()
    bare.model_config.model = "/nonexistent-target"
    with pytest.raises(ValueError, match="no parallel_decoding_config.json"):
        DeerProposer(bare)


def test_the_proposers_stop_drafting_under_load_by_default():
    from hf_paralleldecode.serving.vllm import DeerProposer

    rows = np.array([[1, 2, 3, 1, 2, 3, 1, 2]] * 5, dtype=np.int32)
    context = ContextProposer(_config())
    assert context.propose([[2]] * 5, np.array([8] * 5), rows) == [[]] * 5  # more than 4 requests decoding
    assert all(context.propose([[2]] * 4, np.array([8] * 4), rows[:4]))
    deer = DeerProposer(_deer_config())
    assert deer.propose([[2]] * 2, np.array([8, 8]), rows[:2]) == [[], []]  # DEER drafts for one request only
    assert len(deer.propose([[2]], np.array([8]), rows[:1])[0]) == 8


def _fp32(cls, **settings):
    return type(cls.__name__, (cls,), {"drafter_dtype": "float32", "max_requests": None, **settings})


def test_deer_chain_is_cut_where_the_drafters_confidence_falls(greedy_streams):
    import torch

    from hf_paralleldecode.serving.vllm import DeerProposer

    full, cut = _fp32(DeerProposer)(_deer_config()), _fp32(DeerProposer, min_confidence=0.3)(_deer_config())
    assert full.min_confidence is None  # the default: 0.3 measured no faster in vLLM here (docs/serve.md)
    shorter = 0
    for prompt_len, stream in greedy_streams:
        for n in range(prompt_len + 1, len(stream), 5):
            tokens = np.array([stream[:n]], dtype=np.int32)
            a = full.propose([[1]], np.array([n]), tokens)[0]
            b = cut.propose([[1]], np.array([n]), tokens)[0]
            assert len(a) == 8 and b == a[: len(b)]
            shorter += len(b) < len(a)
    assert shorter  # some depth of some step falls below 0.3
    logits = torch.full((4, 10), -10.0)
    logits[:, 3] = 5.0
    logits[2] = 0.0  # depth 3 is a uniform guess (probability 0.1)
    assert cut.chain_of(logits) == [3, 3]
    assert full.chain_of(logits) == [3, 3, 0, 3]


@pytest.mark.parametrize("bad", [{"min_confidence": 1.0}, {"min_confidence": -0.1}, {"max_catch_up": 0}])
def test_deer_proposer_refuses_bad_settings(bad):
    from hf_paralleldecode.serving.vllm import DeerProposer

    with pytest.raises(ValueError, match=next(iter(bad))):
        type("Bad", (DeerProposer,), bad)(_deer_config())


def test_deer_proposer_restarts_a_state_that_lags_too_far(greedy_streams):
    from hf_paralleldecode.serving.vllm import DeerProposer

    prompt_len, stream = greedy_streams[0]
    proposer = _fp32(DeerProposer, max_catch_up=4)(_deer_config())
    n = prompt_len + 1
    tokens = np.array([stream], dtype=np.int32)
    proposer.propose([[1]], np.array([n]), tokens)
    (entry,) = [e for entries in proposer.requests._by_key.values() for e in entries]
    state = entry.state.state
    proposer.propose([[1]], np.array([n + 3]), tokens)  # 3 new tokens: caught up in the same state
    assert entry.state.state is state
    proposer.propose([[1]], np.array([n + 9]), tokens)  # 6 more: past max_catch_up, a fresh state
    assert entry.state.state is not state
    fresh = _fp32(DeerProposer)(_deer_config())
    assert proposer.propose([[1]], np.array([n + 12]), tokens) == fresh.propose([[1]], np.array([n + 12]), tokens)


def test_the_serve_page_shows_the_engine_and_proposers_vllm_check_runs():
    import importlib.util
    import re

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("vllm_check", root / "scripts" / "vllm_check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)  # (vLLM itself is imported only inside its functions)
    page = (root / "docs" / "serve.md").read_text()
    source = (root / "scripts" / "vllm_check.py").read_text()
    engine = 'dtype="float32", max_model_len=1024, enforce_eager=True'
    assert engine in page and engine in source  # the LLM(...) of the page's examples is the check's
    ours = {c["model"] for c, _ in check.METHODS.values() if c and c.get("model", "").startswith("hf_paralleldecode.")}
    assert ours == {"hf_paralleldecode.serving.vllm.ContextProposer", "hf_paralleldecode.serving.vllm.DeerProposer"}
    for path in ours:
        assert path.rsplit(".", 1)[1] in page
    assert '"method": "custom_class"' in page
    for command in re.findall(r"`(bash scripts/vllm-check\.sh[^`]*)`", page):
        options = set(re.findall(r"--[a-z-]+", command))
        assert options <= set(re.findall(r'"(--[a-z-]+)"', source)), command  # every option the page shows exists
