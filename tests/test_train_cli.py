"""`hf-paralleldecode train --config RECIPE.yaml`: in-process, under accelerate with 2 processes, bad recipes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from models import launch_two_processes, tiny_model, word_tokenizer

import hf_paralleldecode as hfpd
from hf_paralleldecode import cli
from hf_paralleldecode.training.trajectories import collect_trajectories


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_cli")
    model = tiny_model("llama")
    model.save_pretrained(root / "model")
    word_tokenizer().save_pretrained(root / "model")
    collect_trajectories(model, word_tokenizer(), [f"t{5 + i} t{6 + i}" for i in range(8)], root / "traj",
                         block_size=4, max_new_tokens=12, batch_size=8, progress=False)
    return root


def _recipe(root: Path, method: str, out: Path) -> Path:
    recipe = dict(method=method, model_name_or_path=str(root / "model"), trajectories=str(root / "traj"),
                  output_dir=str(out), block_size=4, per_device_train_batch_size=2, max_steps=4, learning_rate=1e-3,
                  logging_steps=1, save_strategy="no", use_cpu=True, report_to="none", seed=0)
    path = out.parent / f"{method}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.parametrize("method, decoding", [("jacobi_forcing", "jacobi_forcing"), ("cllm", "jacobi")])
def test_train_cli_in_process_with_override(setup, tmp_path, method, decoding):
    out = tmp_path / "out"
    assert cli.main(["train", "--config", str(_recipe(setup, method, out)), "--max_steps", "3"]) == 0
    info = json.loads((out / "train_info.json").read_text())
    assert info["world_size"] == 1 and info["steps"] == 3  # the command-line override won
    assert (out / "tokenizer.json").is_file()  # the checkpoint is self-contained
    model = hfpd.load_model(out)
    ids = torch.tensor([[5, 6, 7]])
    res = model.generate(input_ids=ids, max_new_tokens=10, return_dict_in_generate=True)
    assert res.decoding == decoding
    assert torch.equal(res.sequences, model.generate(input_ids=ids, max_new_tokens=10, decoding="stock"))


def test_bad_recipes(tmp_path, capsys):
    assert cli.main(["train", "--config", str(tmp_path / "missing.yaml")]) == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("method: diffusion\n")
    assert cli.main(["train", "--config", str(bad)]) == 2
    assert "method" in capsys.readouterr().err


@pytest.mark.slow
def test_two_processes_under_accelerate_launch(setup, tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2` on a CPU machine runs 2 processes (gloo)."""
    out = tmp_path / "out"
    recipe = _recipe(setup, "jacobi_forcing", out)
    launch_two_processes(["train", "--config", str(recipe)])
    info = json.loads((out / "train_info.json").read_text())
    assert info["world_size"] == 2
    model = hfpd.load_model(out)
    ids = torch.tensor([[5, 6, 7]])
    assert torch.equal(model.generate(input_ids=ids, max_new_tokens=10, do_sample=False),
                       model.generate(input_ids=ids, max_new_tokens=10, decoding="stock", do_sample=False))


@pytest.mark.parametrize("attention", ["tree_causal", "block_bidirectional"])
def test_train_cli_draft_head_recipe(setup, tmp_path, attention):
    from hf_paralleldecode.training.regenerate import regenerate

    regen = tmp_path / "regen"
    regenerate(tiny_model("llama"), word_tokenizer(), [f"t{5 + i} t{6 + i}" for i in range(8)], regen,
               max_new_tokens=12, progress=False)
    recipe = dict(method="draft_head", model_name_or_path=str(setup / "model"), trajectories=str(regen),
                  output_dir=str(tmp_path / "head"), head_attention=attention, head_num_hidden_layers=1,
                  head_block_size=3, max_anchors=8, per_device_train_batch_size=4, max_steps=2, learning_rate=1e-3,
                  logging_steps=1, save_strategy="no", use_cpu=True, report_to="none", seed=0)
    path = tmp_path / "dh.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert cli.main(["train", "--config", str(path)]) == 0
    head = hfpd.DraftHead.from_pretrained(tmp_path / "head")
    assert head.config.attention == attention and head.config.block_size == 3
    target = hfpd.load_model(setup / "model", drafter=tmp_path / "head")
    ids = torch.tensor([[5, 6, 7]])
    out = target.generate(input_ids=ids, max_new_tokens=10, return_dict_in_generate=True)
    assert out.decoding == "speculative"
    assert torch.equal(out.sequences, target.generate(input_ids=ids, max_new_tokens=10, decoding="stock"))


@pytest.mark.parametrize("attention", ["block_causal", "bidirectional"])
def test_train_cli_deer_recipe_stage_one_then_two(setup, tmp_path, attention):
    from hf_paralleldecode.training.regenerate import regenerate

    regen = tmp_path / "regen"
    regenerate(tiny_model("llama"), word_tokenizer(), [f"t{5 + i} t{6 + i}" for i in range(8)], regen,
               max_new_tokens=12, progress=False)
    common = dict(method="deer", model_name_or_path=str(setup / "model"), trajectories=str(regen), max_anchors=4,
                  per_device_train_batch_size=4, max_steps=2, learning_rate=1e-3, logging_steps=1,
                  save_strategy="no", use_cpu=True, report_to="none", seed=0)
    stages = [dict(output_dir=str(tmp_path / "one"), drafter_attention=attention, drafter_num_hidden_layers=1,
                   drafter_block_size=3, drafter_boundary_token=True, stage=1),
              dict(output_dir=str(tmp_path / "two"), init_drafter=str(tmp_path / "one"), stage=2, gamma=2.0)]
    for i, spec in enumerate(stages):
        path = tmp_path / f"deer{i}.yaml"
        path.write_text(yaml.safe_dump({**common, **spec}))
        assert cli.main(["train", "--config", str(path)]) == 0
    drafter = hfpd.DiffusionDrafter.from_pretrained(tmp_path / "two")
    assert drafter.config.attention == attention and drafter.config.block_size == 3
    assert drafter.config.boundary_token_id == 98 and drafter.config.tokenizer_fingerprint is not None
    target = hfpd.load_model(setup / "model", drafter=tmp_path / "two")
    ids = torch.tensor([[5, 6, 7]])
    out = target.generate(input_ids=ids, max_new_tokens=10, return_dict_in_generate=True)
    assert out.decoding == "speculative" and out.stats["drafter"] == "diffusion"
    assert torch.equal(out.sequences, target.generate(input_ids=ids, max_new_tokens=10, decoding="stock"))


def test_draft_head_recipe_seed_makes_the_run_reproducible(setup, tmp_path):
    """The recipe's seed also seeds the new head's initialisation (two runs give the same head)."""
    from safetensors.torch import load_file

    from hf_paralleldecode.training.regenerate import regenerate

    regen = tmp_path / "regen"
    regenerate(tiny_model("llama"), word_tokenizer(), ["t5 t6 t7", "t8 t9"], regen, max_new_tokens=8, progress=False)
    heads = []
    for name in ("a", "b"):
        spec = dict(method="draft_head", model_name_or_path=str(setup / "model"), trajectories=str(regen),
                    output_dir=str(tmp_path / name), head_num_hidden_layers=1, head_block_size=3, max_anchors=8,
                    per_device_train_batch_size=2, max_steps=1, logging_steps=1, save_strategy="no", use_cpu=True,
                    report_to="none", seed=7)
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(spec))
        assert cli.main(["train", "--config", str(tmp_path / f"{name}.yaml")]) == 0
        heads.append(load_file(tmp_path / name / "model.safetensors"))
    assert all(torch.equal(heads[0][k], heads[1][k]) for k in heads[0])


@pytest.mark.slow
def test_draft_head_two_processes_under_accelerate_launch_equal_one_process(setup, tmp_path):
    """2 processes x 2 rows = 1 process x 4 rows, step for step: the loss is normalised over processes."""
    from safetensors.torch import load_file

    from hf_paralleldecode.training.regenerate import regenerate

    regen = tmp_path / "regen"
    regenerate(tiny_model("llama"), word_tokenizer(), [f"t{5 + i} t{6 + i} t{9 + i}" for i in range(4)], regen,
               max_new_tokens=10, progress=False)

    def recipe(name, batch):
        spec = dict(method="draft_head", model_name_or_path=str(setup / "model"), trajectories=str(regen),
                    output_dir=str(tmp_path / name), head_attention="tree_causal", head_num_hidden_layers=1,
                    head_block_size=3, max_anchors=100, per_device_train_batch_size=batch, max_steps=1,
                    learning_rate=1.0, optim="sgd", lr_scheduler_type="constant", warmup_steps=0, logging_steps=1,
                    save_strategy="no", use_cpu=True, report_to="none", seed=0)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(spec))
        return path

    assert cli.main(["train", "--config", str(recipe("one", 4))]) == 0
    launch_two_processes(["train", "--config", str(recipe("two", 2))])
    assert json.loads((tmp_path / "two" / "train_info.json").read_text())["world_size"] == 2
    one, two = (load_file(tmp_path / n / "model.safetensors") for n in ("one", "two"))
    assert one.keys() == two.keys()
    for key in one:
        torch.testing.assert_close(one[key], two[key], rtol=1e-4, atol=1e-6)


#: the published configs of the recipes' Hub targets (no Hub access here): sizes only, enough to build on meta
HUB_CONFIGS = {
    "Qwen/Qwen3-8B": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                          max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                          tie_word_embeddings=False),
    "Qwen/Qwen2.5-Coder-7B-Instruct": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944,
                                           num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                                           vocab_size=152064, max_position_embeddings=32768, rope_theta=1000000.0,
                                           rms_norm_eps=1e-6, tie_word_embeddings=False),
    "Qwen/Qwen2.5-Math-7B-Instruct": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944,
                                          num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                                          vocab_size=152064, max_position_embeddings=4096, rope_theta=10000.0,
                                          rms_norm_eps=1e-6, tie_word_embeddings=False),
}
RECIPES = sorted(Path(__file__).resolve().parent.parent.glob("recipes/*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_every_recipe_passes_a_dry_run(recipe, tmp_path, capsys):
    """Every shipped recipe parses, validates and builds its model (meta device) and head without weights or data."""
    from transformers import AutoConfig

    spec = yaml.safe_load(recipe.read_text())
    extra = []
    if spec["model_name_or_path"] in HUB_CONFIGS:
        local = tmp_path / "config"
        AutoConfig.for_model(**HUB_CONFIGS[spec["model_name_or_path"]]).save_pretrained(local)
        extra = ["--model_name_or_path", str(local)]
    else:
        assert spec["model_name_or_path"] in ("default", "default-trained"), "add the Hub config of a new target"
    assert cli.main(["train", "--config", str(recipe), "--dry-run", *extra]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["method"] == spec["method"]
    if "init_drafter" in spec:  # a later stage starts from the previous one's output: its size is known then
        assert summary["trainable_parameters"] is None and summary["drafter"]["init_drafter"] == spec["init_drafter"]
    else:
        assert summary["trainable_parameters"] > 0
    if spec["method"] == "draft_head":
        head = summary["head"]
        assert head["block_size"] == spec["head_block_size"]
        assert head["num_hidden_layers"] == spec["head_num_hidden_layers"]
        if "head_target_layer_ids" in spec:
            assert head["target_layer_ids"] == spec["head_target_layer_ids"]
        assert summary["trains"].startswith("the draft head only")
        if spec["model_name_or_path"] == "Qwen/Qwen3-8B":  # the seed's settings, and a ~1B head (SpecForge's size)
            assert (head["num_hidden_layers"], head["block_size"], spec["learning_rate"],
                    spec["per_device_train_batch_size"]) == (5, 16, 3e-4, 2)
            assert head["mask_token_id"] == 151669 and 0.9e9 < head["parameters"] < 1.2e9
            assert summary["target_parameters"] > 7.5e9
    if spec["method"] == "deer" and "init_drafter" not in spec:
        drafter = summary["drafter"]
        assert drafter["block_size"] == spec["drafter_block_size"] and drafter["parameters"] > 0
        assert summary["trains"].startswith("the diffusion drafter only")
    assert not Path(spec["output_dir"]).exists() or spec["model_name_or_path"] in ("default", "default-trained")


def test_train_help_lists_the_recipe_fields(capsys):
    assert cli.main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    for name in ("model_name_or_path", "noise_schedule", "max_anchors", "objective", "consistency"):
        assert name in out
    assert cli.main(["train", "--method", "draft_head", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--loss_chunk_size" in out and "--learning_rate" in out  # HfArgumentParser's full listing


def test_unknown_or_abbreviated_keys_name_the_closest_field(setup, tmp_path, capsys):
    recipe = _recipe(setup, "jacobi_forcing", tmp_path / "out")
    spec = yaml.safe_load(recipe.read_text())
    spec["noise_schedul"] = "linear"  # a prefix of noise_schedule: never matched silently
    recipe.write_text(yaml.safe_dump(spec))
    assert cli.main(["train", "--config", str(recipe)]) == 2
    assert "'noise_schedul'" in (err := capsys.readouterr().err) and "did you mean 'noise_schedule'" in err
    good = _recipe(setup, "jacobi_forcing", tmp_path / "out2")
    assert cli.main(["train", "--config", str(good), "--max_step", "2"]) == 2
    assert "did you mean 'max_steps'" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the other subcommands do not match prefixes either
        cli.main(["bench", "--max-new", "4"])
    assert "unrecognized arguments: --max-new" in capsys.readouterr().err


def _run_env_command_that_starts_a_group(monkeypatch, tmp_path, fails=False):
    """``cli.main(["env"])`` whose command starts a 1-process gloo group, as accelerate does under a launcher."""
    import torch.distributed as dist

    def command(_args):
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
        if fails:
            raise ValueError("the command failed")
        return 0

    monkeypatch.setattr(cli, "_env", command)
    try:
        return cli.main(["env"])
    except SystemExit as exit_:
        return exit_.code


@pytest.fixture
def no_group_left():
    import torch.distributed as dist

    yield dist
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_process_group_the_command_started_is_destroyed_when_it_succeeds(monkeypatch, tmp_path, no_group_left):
    """Left to the interpreter's exit, gloo's threads can abort a finished run (SIGABRT) under accelerate launch."""
    assert _run_env_command_that_starts_a_group(monkeypatch, tmp_path) == 0
    assert not no_group_left.is_initialized()


def test_a_failing_command_leaves_its_process_group(monkeypatch, tmp_path, no_group_left):
    """Another rank may still be in a collective: destroying the group then could hang it."""
    assert _run_env_command_that_starts_a_group(monkeypatch, tmp_path, fails=True) == 2
    assert no_group_left.is_initialized()


def test_the_callers_process_group_is_left_alone(monkeypatch, tmp_path, no_group_left):
    no_group_left.init_process_group("gloo", init_method=f"file://{tmp_path / 'own'}", rank=0, world_size=1)
    assert _run_env_command_that_starts_a_group(monkeypatch, tmp_path) == 0
    assert no_group_left.is_initialized()


def test_train_cli_eagle3_recipe_with_a_reduced_vocabulary_and_a_resumed_run(setup, tmp_path, capsys):
    """method: eagle3 trains a drafter over the data's most frequent tokens; --resume_from_checkpoint continues a
    run from its checkpoint (the step count goes on, it does not restart); the dry run sizes it on the meta device."""
    from hf_paralleldecode.training.regenerate import regenerate

    regen = tmp_path / "regen"
    regenerate(tiny_model("llama"), word_tokenizer(), [f"t{5 + i} t{6 + i}" for i in range(8)], regen,
               max_new_tokens=12, progress=False)
    recipe = dict(method="eagle3", model_name_or_path=str(setup / "model"), trajectories=str(regen),
                  output_dir=str(tmp_path / "e3"), draft_vocab_size=40, ttt_steps=2, per_device_train_batch_size=4,
                  max_steps=2, learning_rate=1e-3, logging_steps=1, save_steps=1, use_cpu=True, report_to="none",
                  seed=0)
    path = tmp_path / "e3.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert cli.main(["train", "--config", str(path), "--dry-run"]) == 0
    assert json.loads(capsys.readouterr().out)["drafter"]["draft_vocab_size"] == 40
    assert cli.main(["train", "--config", str(path)]) == 0
    drafter = hfpd.load_drafter(tmp_path / "e3")
    assert isinstance(drafter, hfpd.Eagle3Drafter) and drafter.config.draft_vocab_size == 40
    assert cli.main(["train", "--config", str(path), "--max_steps", "3",
                     "--resume_from_checkpoint", str(tmp_path / "e3" / "checkpoint-2")]) == 0
    state = json.loads((tmp_path / "e3" / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["global_step"] == 3 and [h["step"] for h in state["log_history"] if "loss" in h] == [1, 2, 3]
    target = hfpd.load_model(setup / "model", drafter=tmp_path / "e3")
    ids = torch.tensor([[5, 6, 7]])
    assert torch.equal(target.generate(input_ids=ids, max_new_tokens=10),
                       target.generate(input_ids=ids, max_new_tokens=10, decoding="stock"))


# ---- issue 64 (day-one round 5): every bad recipe is an `error:` line and exit 2; dry run = the real run's checks --
def _write_bad_recipe(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / {"jsonl": "conv.jsonl", "directory": "recipes"}.get(kind, f"{kind}.yaml")
    if kind == "jsonl":  # a dataset passed by mistake: one JSON object a line is not one YAML document
        path.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n'
                        '{"messages": [{"role": "user", "content": "bye"}]}\n')
    elif kind == "empty":
        path.write_text("\n# nothing but a comment\n")
    elif kind == "list":
        path.write_text("- method: cllm\n- model_name_or_path: default\n")
    elif kind == "scalar":
        path.write_text("cllm\n")
    elif kind == "numeric_keys":
        path.write_text("method: cllm\n1: 2\n")
    elif kind == "directory":
        path.mkdir()
    elif kind == "binary":
        path.write_bytes(bytes(range(256)) * 4)
    elif kind == "tab_indented":
        path.write_text("method: cllm\n\tblock_size: 4\n")
    return path


@pytest.mark.parametrize("kind, says", [
    ("jsonl", "is not valid YAML"), ("empty", "is empty"), ("list", "holds a YAML list"),
    ("scalar", "holds a YAML str"), ("numeric_keys", "keys must be field names"), ("missing", "does not exist"),
    ("directory", "is a directory"), ("binary", "is not a text file"), ("tab_indented", "is not valid YAML"),
])
@pytest.mark.parametrize("dry_run", [False, True])
def test_cli_day_one_a_recipe_that_is_not_a_yaml_mapping_is_an_error_line_and_exit_2(tmp_path, capsys, kind, says,
                                                                                     dry_run):
    path = _write_bad_recipe(tmp_path, kind)
    assert cli.main(["train", "--config", str(path), *(["--dry-run"] if dry_run else [])]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: Recipe ") and says in err and str(path) in err and "Traceback" not in err
    assert "recipes/" in err  # the fix: what a recipe looks like


def test_cli_day_one_help_with_a_bad_recipe_is_the_same_error(tmp_path, capsys):
    path = _write_bad_recipe(tmp_path, "jsonl")
    assert cli.main(["train", "--config", str(path), "--help"]) == 2
    assert "is not valid YAML" in capsys.readouterr().err
    assert cli.main(["train", "--config", str(tmp_path / "missing.yaml"), "--help"]) == 0  # the general help


def _no_model_load(monkeypatch):
    """The checks run before any weights load: loading them fails the test."""
    from transformers import AutoModelForCausalLM

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the recipe's data was checked")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)


def _dry_and_real(recipe: Path, capsys, monkeypatch, *extra) -> list[str]:
    """The error of ``--dry-run`` and of the real run (each exit 2, before any weights load)."""
    errors = []
    for dry in (["--dry-run"], []):
        with monkeypatch.context() as m:
            _no_model_load(m)
            assert cli.main(["train", "--config", str(recipe), *dry, *extra]) == 2
        errors.append(capsys.readouterr().err)
    return errors


def test_cli_day_one_dry_run_refuses_a_block_size_the_data_was_not_collected_with(setup, tmp_path, capsys,
                                                                                   monkeypatch):
    recipe = _recipe(setup, "jacobi_forcing", tmp_path / "out")
    dry, real = _dry_and_real(recipe, capsys, monkeypatch, "--block_size", "8")
    assert dry == real and "collected with block size 4 but the config says block_size=8" in dry
    assert not (tmp_path / "out").exists()
    assert cli.main(["train", "--config", str(recipe), "--dry-run"]) == 0  # the matching block size passes
    summary = json.loads(capsys.readouterr().out)
    assert summary["data_exists"] is True and summary["data_checked"] is True


def test_cli_day_one_dry_run_refuses_data_of_the_other_kind_or_another_tokenizer(setup, tmp_path, capsys,
                                                                                  monkeypatch):
    import shutil

    from hf_paralleldecode.training.regenerate import regenerate

    regen = tmp_path / "regen"
    regenerate(tiny_model("llama"), word_tokenizer(), ["t5 t6 t7", "t8 t9"], regen, max_new_tokens=8, progress=False)
    capsys.readouterr()
    wrong_kind = _recipe(setup, "cllm", tmp_path / "out")  # regenerated continuations are no trajectories
    spec = yaml.safe_load(wrong_kind.read_text())
    wrong_kind.write_text(yaml.safe_dump({**spec, "trajectories": str(regen)}))
    dry, real = _dry_and_real(wrong_kind, capsys, monkeypatch)
    assert dry == real and "trajectories" in dry and "hf-paralleldecode collect" in dry
    head = dict(method="draft_head", model_name_or_path=str(setup / "model"), trajectories=str(setup / "traj"),
                output_dir=str(tmp_path / "head"), head_num_hidden_layers=1, head_block_size=3, max_steps=1,
                use_cpu=True, report_to="none")
    (tmp_path / "head.yaml").write_text(yaml.safe_dump(head))  # trajectories are no regenerated continuations
    dry, real = _dry_and_real(tmp_path / "head.yaml", capsys, monkeypatch)
    assert dry == real and "input_ids" in dry and "hf-paralleldecode regenerate" in dry
    other = tmp_path / "other_tokenizer"
    shutil.copytree(setup / "traj", other)
    config = json.loads((other / "collection_config.json").read_text())
    (other / "collection_config.json").write_text(json.dumps({**config, "tokenizer": "0" * 16}))
    recipe = _recipe(setup, "cllm", tmp_path / "out")
    dry, real = _dry_and_real(recipe, capsys, monkeypatch, "--trajectories", str(other))
    assert dry == real and "written with another tokenizer" in dry


def test_cli_day_one_a_null_recipe_value_is_a_none_default_and_refused_elsewhere(setup, tmp_path, capsys):
    recipe = dict(method="draft_head", model_name_or_path=str(setup / "model"), trajectories=str(tmp_path / "none"),
                  output_dir=str(tmp_path / "head"), head_num_hidden_layers=1, head_block_size=3,
                  head_mask_token_id=None, head_target_layer_ids=None, init_head=None, use_cpu=True, report_to="none")
    path = tmp_path / "head.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert cli.main(["train", "--config", str(path), "--dry-run", "--gamma", "None"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["head"]["mask_token_id"] == 96 and summary["gamma"] is None
    path.write_text(yaml.safe_dump({**recipe, "max_steps": None}))
    assert cli.main(["train", "--config", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "`max_steps: null`" in err and "remove the line" in err
