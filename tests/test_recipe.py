"""Recipes: MindFormers configs load unchanged, memopt keys validate with clear messages."""
from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from ms_memopt.cli import main
from ms_memopt.config.recipe import MemoptConfig, llama_ffn_size, load_recipe, recipe_from_dict
from ms_memopt.core.errors import InputError

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
LLAMA70B = SHARED / "configs" / "mindformers" / "pretrain_llama2_70b.yaml"

TINY = {"model": {"model_config": {"num_layers": 4, "hidden_size": 64, "num_heads": 4,
                                   "seq_length": 32, "vocab_size": 256}}}


def _tiny(**sections) -> dict:
    data = copy.deepcopy(TINY)
    for name, value in sections.items():
        data[name] = value
    return data


def _error(data: dict) -> str:
    with pytest.raises(InputError) as info:
        recipe_from_dict(data, source="r.yaml")
    return str(info.value)


def _need_70b() -> Path:
    if not LLAMA70B.exists():
        pytest.skip(f"shared MindFormers config not found at {LLAMA70B}")
    return LLAMA70B


# --- defaults and MindFormers compatibility -------------------------------------------------

def test_minimal_recipe_gets_documented_defaults():
    r = recipe_from_dict(TINY)
    assert r.model.n_kv_heads == 4 and r.model.ffn_gated
    assert r.model.intermediate_size == llama_ffn_size(64) == 256
    assert r.model.compute_dtype == r.model.param_init_type == "bfloat16"
    assert (r.parallel.data_parallel, r.parallel.model_parallel, r.parallel.pipeline_stage) == (1, 1, 1)
    assert (r.memopt.workload.seq_min, r.memopt.workload.seq_max) == (4, 32)   # seq_length / 8 .. seq_length
    assert dataclasses.replace(r.memopt, workload=MemoptConfig().workload) == MemoptConfig(grad_dtype="bfloat16")
    assert r.memopt.zero_stage == 0 and r.memopt.master_weights
    assert r.memopt.allocator.increase_size == 2**30 and not r.memopt.allocator.pregrow
    assert r.capacity is None


def test_llama2_70b_mindformers_config_loads_unchanged():
    r = load_recipe(_need_70b())
    assert r.model.num_layers == 80 and r.model.n_kv_heads == 8
    assert r.model.intermediate_size == 28416          # ffn_dim_multiplier 1.3, multiple_of 256
    assert r.model.use_flash_attention and r.model.param_init_type == "float16"
    assert (r.parallel.data_parallel, r.parallel.model_parallel, r.parallel.pipeline_stage) == (2, 4, 8)
    assert r.parallel.micro_batch_num == 128 and r.parallel.use_seq_parallel
    assert r.memopt.zero_stage == 1                     # enable_parallel_optimizer: True
    assert r.memopt.optimizer_dtype == "float32"        # FP32StateAdamWeightDecay
    assert r.train.max_device_memory == 56 * 2**30      # "56GB" means GiB in MindSpore
    assert r.capacity == 56 * 2**30
    assert r.stage_layers() == [10] * 8


def test_shipped_recipes_load():
    for name in ("dense_100b_1024x910c.yaml", "atlas_single_card.yaml", "demo_cpu.yaml"):
        r = load_recipe(REPO / "recipes" / name)
        assert r.capacity and r.capacity > 0, name
    big = load_recipe(REPO / "recipes" / "dense_100b_1024x910c.yaml")
    assert big.parallel.cards == big.memopt.device.cards == 1024
    assert big.memopt.watch == {"allreduce": 4_200_000_000}
    assert big.memopt.grad_dtype == "float32"
    assert (big.memopt.scan_every, big.memopt.compact_every) == (100, 500)
    demo = load_recipe(REPO / "recipes" / "demo_cpu.yaml")
    assert 2 <= demo.model.num_layers <= 4 and demo.model.hidden_size == 64 and demo.model.seq_length == 32


def test_unknown_mindformers_sections_and_keys_are_ignored():
    data = _tiny(trainer={"type": "CausalLanguageModelingTrainer"}, callbacks=[{"type": "MFLossMonitor"}],
                 processor={"tokenizer": {"type": "LlamaTokenizer"}}, something_new=3)
    data["model"]["model_config"]["rotary_dtype"] = "float16"
    recipe_from_dict(data)


def test_sizes_and_counts_accept_strings_pyyaml_leaves_as_text():
    text = """
model: {model_config: {num_layers: 4, hidden_size: 64, num_heads: 4, seq_length: 32, vocab_size: 256}}
memopt:
  params: 7.5e9
  watch: {allreduce: 4.2GB, small: 512MiB}
  device: {hbm: 96GiB}
"""
    data = yaml.safe_load(text)
    assert data["memopt"]["params"] == "7.5e9"          # the PyYAML trap the loader must handle
    r = recipe_from_dict(data)
    assert r.memopt.params == 7_500_000_000
    assert r.memopt.watch == {"allreduce": 4_200_000_000, "small": 512 * 2**20}
    assert r.memopt.device.hbm == 96 * 2**30
    assert recipe_from_dict(_tiny(memopt={"params": "100B"})).memopt.params == 100 * 10**9


def test_recompute_per_stage_lists():
    data = _tiny(parallel_config={"pipeline_stage": 2, "micro_batch_num": 4},
                 recompute_config={"recompute": [2, 1], "select_recompute": True,
                                   "select_comm_recompute": ["feed_forward\\.w1"]})
    r = recipe_from_dict(data)
    assert r.recompute.recompute == (2, 1)
    assert r.recompute.select_recompute is True and r.recompute.select_comm_recompute is True


def test_zero_stage_defaults_follow_parallel_optimizer():
    assert recipe_from_dict(_tiny(parallel={"enable_parallel_optimizer": True})).memopt.zero_stage == 1
    assert recipe_from_dict(_tiny(parallel={"enable_parallel_optimizer": True},
                                  memopt={"zero_stage": 3})).memopt.zero_stage == 3


def test_grad_dtype_defaults():
    assert recipe_from_dict(TINY).memopt.grad_dtype == "bfloat16"
    data = _tiny()
    data["model"]["model_config"].update(param_init_type="float32", compute_dtype="bfloat16")
    assert recipe_from_dict(data).memopt.grad_dtype == "float32"


# --- errors ---------------------------------------------------------------------------------

def test_yaml_syntax_error_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  model_config:\n    num_layers: [1, 2\n    hidden_size: 4\n")
    with pytest.raises(InputError) as info:
        load_recipe(bad)
    assert info.value.source == str(bad) and info.value.line is not None and info.value.line >= 3
    assert "invalid YAML" in str(info.value)


def test_missing_file_is_input_error(tmp_path):
    with pytest.raises(InputError, match="cannot read"):
        load_recipe(tmp_path / "nope.yaml")


def test_unknown_memopt_key_suggests_the_right_one():
    msg = _error(_tiny(memopt={"zero_stag": 1}))
    assert "memopt.zero_stag" in msg and "did you mean 'zero_stage'" in msg
    msg = _error(_tiny(memopt={"allocator": {"pregrw": True}}))
    assert "memopt.allocator.pregrw" in msg and "'pregrow'" in msg
    msg = _error(_tiny(memopt={"workload": {"shape_cache": {"bytes_per_shap": "1MiB"}}}))
    assert "memopt.workload.shape_cache.bytes_per_shap" in msg and "'bytes_per_shape'" in msg


def test_retired_allocator_align_loads_with_a_note_at_512_and_fails_otherwise():
    # memopt.allocator.align was parsed and read by nothing; every allocator model aligns to 512 B
    r = recipe_from_dict(_tiny(memopt={"allocator": {"align": 512}}))
    assert not hasattr(r.memopt.allocator, "align")
    assert any("memopt.allocator.align" in n and "512" in n for n in r.notes)
    msg = _error(_tiny(memopt={"allocator": {"align": 1024}}))
    assert msg.startswith("r.yaml: memopt.allocator.align: got 1024") and "remove the key" in msg
    # a typo is not steered to the retired key
    msg = _error(_tiny(memopt={"allocator": {"alig": 512}}))
    assert "memopt.allocator.alig" in msg and "'align'" not in msg


def test_seq_min_default_never_exceeds_a_given_seq_max():
    r = recipe_from_dict(_tiny(memopt={"workload": {"seq_max": 2}}))    # seq_length 32: // 8 = 4 > 2
    assert (r.memopt.workload.seq_min, r.memopt.workload.seq_max) == (2, 2)


@pytest.mark.parametrize("mutate, key, expected", [
    (lambda d: d["model"]["model_config"].update(num_layers="many"), "model.model_config.num_layers", "integer"),
    (lambda d: d["model"]["model_config"].update(hidden_size=-64), "model.model_config.hidden_size", ">= 1"),
    (lambda d: d["model"]["model_config"].update(num_layers=2.5), "model.model_config.num_layers", "integer"),
    (lambda d: d["model"]["model_config"].update(compute_dtype="int8"), "model.model_config.compute_dtype", "float16"),
    (lambda d: d["model"]["model_config"].update(num_heads=5), "model.model_config.num_heads", "divisor"),
    (lambda d: d["model"]["model_config"].pop("vocab_size"), "model.model_config.vocab_size", "missing"),
    (lambda d: d.update(memopt={"device": {"hbm": "0GB"}}), "memopt.device.hbm", "positive size"),
    (lambda d: d.update(memopt={"device": {"hbm": "lots"}}), "memopt.device.hbm", "4.2GB"),
    (lambda d: d.update(memopt={"zero_stage": 4}), "memopt.zero_stage", "from 0 to 3"),
    (lambda d: d.update(memopt={"master_weights": "yes"}), "memopt.master_weights", "true or false"),
    (lambda d: d.update(memopt={"params": "-3B"}), "memopt.params", "non-negative"),
    (lambda d: d.update(memopt={"watch": ["allreduce"]}), "memopt.watch", "mapping"),
    (lambda d: d.update(memopt={"checkpoint_every": 5}), "memopt.checkpoint_every", "at most the layers"),
    (lambda d: d.update(memopt={"device": {"cards": 8}}), "memopt.device.cards", "= 1"),
    (lambda d: d.update(parallel_config={"model_parallel": 8}), "model.model_config.num_heads",
     "multiple of parallel_config.model_parallel"),
    (lambda d: d.update(parallel_config={"pipeline_stage": 2, "micro_batch_num": 4},
                        recompute_config={"recompute": [1, 1, 1]}), "recompute_config.recompute", "2 layer counts"),
    (lambda d: d.update(parallel_config={"pipeline_stage": 8, "micro_batch_num": 8}),
     "parallel_config.pipeline_stage", "num_layers"),
    (lambda d: d.update(context={"max_device_memory": "0GB"}), "context.max_device_memory", "positive"),
    (lambda d: d.update(memopt={"allocator": {"name": "tcmalloc"}}), "memopt.allocator.name", "mindspore"),
    (lambda d: d.update(memopt={"workload": {"seq_max": 64}}), "memopt.workload.seq_max", "seq_length (32)"),
    (lambda d: d.update(memopt={"workload": {"seq_min": 16, "seq_max": 8}}), "memopt.workload.seq_min", "seq_max"),
    (lambda d: d.update(memopt={"workload": {"long_tail": 1.5}}), "memopt.workload.long_tail", "<= 1"),
    (lambda d: d.update(memopt={"workload": {"seq_distribution": "zipf"}}), "memopt.workload.seq_distribution",
     "lognormal"),
])
def test_bad_values_name_key_value_and_expectation(mutate, key, expected):
    data = copy.deepcopy(TINY)
    mutate(data)
    msg = _error(data)
    assert msg.startswith("r.yaml: " + key), msg
    assert expected in msg, msg


def test_cli_exit_code_2_on_bad_recipe(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    data = _tiny(memopt={"compact_evry": 500})
    bad.write_text(yaml.safe_dump(data))
    assert main(["plan", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "memopt.compact_evry" in err and "compact_every" in err


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=20))
def test_any_unknown_memopt_key_is_rejected(key):
    known = set(MemoptConfig.__dataclass_fields__)
    data = _tiny(memopt={key: 1})
    if key in known:
        return
    msg = _error(data)
    assert f"memopt.{key}" in msg


@settings(max_examples=40, deadline=None)
@given(st.integers(min_value=1, max_value=10**6), st.sampled_from(["", "KiB", "MiB", "GiB", "KB", "MB", "GB"]))
def test_size_strings_parse_to_the_right_bytes(number, unit):
    factor = {"": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9}[unit]
    r = recipe_from_dict(_tiny(memopt={"workspace": f"{number}{unit}"}))
    assert r.memopt.workspace == number * factor
