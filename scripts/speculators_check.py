"""The speculators reference check, both directions (run by scripts/speculators-check.sh; two environments).

    python scripts/speculators_check.py ours-export WORK    # this project's env: target, our exports, our logits
    python scripts/speculators_check.py theirs WORK         # speculators' env: load ours, build and save theirs
    python scripts/speculators_check.py ours-import WORK    # this project's env: load theirs, compare everything

Same target features in, draft logits out (fp32, CPU): EAGLE-3 and DFlash, each way. speculators' side is
speculators' own model classes and forwards (``SpeculatorModel.from_pretrained``, ``Eagle3DraftModel.forward``,
``DFlashDraftModel._backbone_forward``); this project's side is ``hf_paralleldecode.load_drafter`` and the drafters'
own forwards.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's hf_paralleldecode

TOL = 1e-4
H, V, VD, L, T, ANCHOR, B = 64, 300, 64, 6, 24, 9, 4  # sizes (notes/drafter-formats.md section 6); DFlash block B


def _inputs(work: Path, taps: int):
    g = torch.Generator().manual_seed(taps)
    return torch.randn(1, T, taps * H, generator=g), torch.randint(0, V - 1, (1, T), generator=g)


# ---- this project's side ----------------------------------------------------------------------------------------
def _our_eagle3_logits(drafter, feats, ids):
    drafter.eval()
    mask = torch.ones(T, T, dtype=torch.bool).tril()[None]
    with torch.no_grad():
        _, logits = drafter(drafter.embed(ids), drafter.fuse(feats), torch.arange(T)[None], mask)
    return logits[0]


def _our_dflash_logits(head, feats, ids):
    from hf_paralleldecode.drafters.head import block_layout
    from hf_paralleldecode.engine.cache import additive_mask

    c = head.config
    slot_ids, pos, intra, _ = block_layout(c.attention, c.block_size, torch.tensor([[ANCHOR]]), ids, c.mask_token_id)
    allowed = torch.cat([torch.ones(1, intra.shape[0], ANCHOR, dtype=torch.bool), intra[None]], dim=-1)
    with torch.no_grad():
        hidden = head(head.embed(slot_ids), feats[:, :ANCHOR], additive_mask(allowed, head.dtype),
                      torch.cat([torch.arange(ANCHOR)[None], pos], dim=1))
        return head.logits(hidden)[0]  # [anchor + B - 1 drafted slots, V]


def ours_export(work: Path):
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_paralleldecode as hfpd

    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=L,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                          max_position_embeddings=512, tie_word_embeddings=False))
    target.save_pretrained(work / "target")
    target = hfpd.load_model(work / "target", dtype=torch.float32)
    eagle = hfpd.Eagle3Drafter.for_target(target, draft_vocab_size=VD, initializer_range=0.2).float()
    eagle.set_draft_vocab(torch.arange(0, 2 * VD, 2))
    eagle.bind(target)
    head = hfpd.DraftHead.for_target(target, attention="block_bidirectional", num_hidden_layers=2, block_size=B - 1,
                                     target_layer_ids=[1, 3], initializer_range=0.2).float().bind(target)
    hfpd.export_drafter(eagle, work / "ours_eagle3", format="speculators", verifier=work / "target")
    hfpd.export_drafter(head, work / "ours_dflash", format="speculators", verifier=work / "target")
    f3, i3 = _inputs(work, 3)
    f2, i2 = _inputs(work, 2)
    torch.save({"eagle3": _our_eagle3_logits(eagle, f3, i3), "dflash": _our_dflash_logits(head, f2, i2)},
               work / "ours_logits.pt")
    print("ours-export: wrote", work / "ours_eagle3", "and", work / "ours_dflash")


def ours_import(work: Path):
    import hf_paralleldecode as hfpd

    target = hfpd.load_model(work / "target", dtype=torch.float32)
    theirs = torch.load(work / "theirs_logits.pt")
    rows = []
    for name, check in (("eagle3", _our_eagle3_logits), ("dflash", _our_dflash_logits)):
        drafter = hfpd.load_drafter(work / f"theirs_{name}", cache=False).float()
        drafter.bind(target)
        feats, ids = _inputs(work, 3 if name == "eagle3" else 2)
        ours = check(drafter, feats, ids)
        ref = theirs[f"theirs_{name}"]
        if name == "dflash":
            ours = ours[1:]  # our drafted depths 1..B-1; their logits hold the anchor slot first
            ref = ref[1:]
        err = float((ours - ref).abs().max())
        rows.append((f"speculators {name} checkpoint -> hf_paralleldecode", err))
    for name in ("eagle3", "dflash"):
        ref, ours = theirs[f"ours_{name}"], torch.load(work / "ours_logits.pt")[name]
        if name == "dflash":
            ref, ours = ref[1:], ours[1:]
        rows.append((f"hf_paralleldecode {name} export -> speculators", float((ours - ref).abs().max())))
    unused = json.loads((work / "theirs_unused.json").read_text())
    print(f"{'direction':56s} max |logit diff|")
    ok = True
    for name, err in rows:
        print(f"{name:56s} {err:.2e}")
        ok &= err <= TOL
    for name, keys in unused.items():
        print(f"{name}: tensors speculators did not use: {keys or 'none'}")
        ok &= not keys
    print("PASS" if ok else "FAIL", f"(tolerance {TOL})")
    return 0 if ok else 1


# ---- speculators' side --------------------------------------------------------------------------------------------
def _their_eagle3_logits(model, feats, ids):
    captured = []
    hook = model.lm_head.register_forward_hook(lambda m, a, out: captured.append(out))
    with torch.no_grad():
        model(hidden_states=feats, input_ids=ids, document_ids=torch.zeros_like(ids),
              position_ids=torch.arange(T)[None], ttt_steps=1)
    hook.remove()
    return captured[0][0]


def _their_dflash_logits(model, feats, ids):
    loss_mask = torch.zeros(1, T, dtype=torch.long)
    loss_mask[0, ANCHOR] = 1
    with torch.no_grad():
        _, logits, *_ = model._backbone_forward(feats, ids, loss_mask, torch.zeros(1, T, H),
                                                torch.zeros_like(ids), max_anchors=1)
    return logits[0]


def _eager(model):
    from speculators.models.attention import create_float_mask

    model.config.transformer_layer_config._attn_implementation = "eager"
    model._attn_impl = "eager"
    model._create_mask_fn = create_float_mask
    return model


def _unused(folder: Path, model) -> list[str]:
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", "pt") as f:
        saved = set(f.keys())
    return sorted(saved - set(model.state_dict()))


def theirs(work: Path):
    from speculators import SpeculatorModel
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import AutoConfig, Qwen3Config

    out, unused = {}, {}
    # this project's exports, loaded by speculators
    for name, run in (("eagle3", _their_eagle3_logits), ("dflash", _their_dflash_logits)):
        folder = work / f"ours_{name}"
        model = _eager(SpeculatorModel.from_pretrained(str(folder))).float().eval()
        unused[f"ours_{name}"] = _unused(folder, model)
        feats, ids = _inputs(work, 3 if name == "eagle3" else 2)
        out[f"ours_{name}"] = run(model, feats, ids)
    # speculators' own models, built and saved by speculators
    verifier = AutoConfig.from_pretrained(work / "target")
    torch.manual_seed(1)
    layer = AutoConfig.from_pretrained(work / "target")
    layer._attn_implementation = "eager"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=VD, norm_before_residual=True,
        eagle_aux_hidden_state_layer_ids=[2, L // 2, L - 3],
        speculators_config=SpeculatorsConfig(algorithm="eagle3", proposal_methods=[
            GreedyTokenProposalConfig(speculative_tokens=3)], default_proposal_method="greedy",
            verifier=VerifierConfig.from_pretrained(str(work / "target"))))
    model = Eagle3DraftModel(config)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.arange(1, 2 * VD, 2)] = True
    model.load_vocab_mappings(t2d, torch.arange(1, 2 * VD, 2) - torch.arange(VD))
    model.load_verifier_weights()
    _perturb(model)
    model.save_pretrained(str(work / "theirs_eagle3"))
    model = _eager(model).float().eval()
    feats, ids = _inputs(work, 3)
    out["theirs_eagle3"] = _their_eagle3_logits(model, feats, ids)

    layer = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                        layer_types=["full_attention"] * 2)
    layer._attn_implementation = "eager"
    config = DFlashSpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=V, block_size=B, target_hidden_size=H,
        aux_hidden_state_layer_ids=[2, 4], mask_token_id=V - 1,
        speculators_config=SpeculatorsConfig(algorithm="dflash", proposal_methods=[
            GreedyTokenProposalConfig(speculative_tokens=B - 1)], default_proposal_method="greedy",
            verifier=VerifierConfig.from_pretrained(str(work / "target"))))
    model = DFlashDraftModel(config)
    model.load_verifier_weights()
    _perturb(model)
    model.save_pretrained(str(work / "theirs_dflash"))
    model = _eager(model).float().eval()
    feats, ids = _inputs(work, 2)
    out["theirs_dflash"] = _their_dflash_logits(model, feats, ids)
    torch.save(out, work / "theirs_logits.pt")
    (work / "theirs_unused.json").write_text(json.dumps(unused))
    print("theirs: loaded our exports, wrote", work / "theirs_eagle3", "and", work / "theirs_dflash")
    del verifier


def _perturb(model):
    """Random norms too (a fresh model's norms are ones): every weight then matters to the comparison."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or ".norm" in name or "_norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))


if __name__ == "__main__":
    mode, work = sys.argv[1], Path(sys.argv[2])
    work.mkdir(parents=True, exist_ok=True)
    sys.exit({"ours-export": ours_export, "theirs": theirs, "ours-import": ours_import}[mode](work) or 0)
