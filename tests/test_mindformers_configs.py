"""plan and simulate read MindFormers' own train configs (1.x and 2.x), and each key family.

MindFormers' YAML files are another project's files: they are not in this repository. The tests
read them from the installed ``mindformers`` package (its wheel ships ``configs/`` beside the
package) and from ``../shared/data/configs/mindformers/``, and skip with a reason when neither
is there. The key families are exercised by small YAMLs written here.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import yaml

from ms_memopt.analysis.estimate import (attention_params, estimate, in_flight_chunks, layer_activation_bytes, logits_bytes,
                                model_params, stage_activation_bytes, stage_param_split)
from ms_memopt.cli import main
from ms_memopt.config.recipe import load_recipe, recipe_from_dict
from ms_memopt.core.errors import InputError

GiB = 2**30
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "configs" / "mindformers"


def _package_configs() -> Path | None:
    """``configs/`` of the installed mindformers wheel, found without importing the package."""
    spec = importlib.util.find_spec("mindformers")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(list(spec.submodule_search_locations)[0]).parent / "configs"
    return folder if folder.is_dir() else None


PACKAGE = _package_configs()
# mindformers 2.0.0's pretrain configs and templates (the issue's list) and what plan says of them
PRETRAIN = {
    "deepseek3/pretrain_deepseek3_671b.yaml": True,
    "deepseek3/pretrain_deepseek3_12b_16p_pp16.yaml": True,
    "deepseek3/pretrain_deepseek3_1b_8p_pynative.yaml": True,
    "qwen3/pretrain_qwen3_32b_4k.yaml": True,
    "qwen3_moe/pretrain_qwen3_30b_a3b_4k.yaml": True,
    "telechat3/pretrain_telechat3_36b.yaml": True,
    "general/llm_pretrain_dense_template.yaml": True,
    # expert_parallel 1: every card of a stage holds all routed experts (FFNGroupedGEMM's
    # (ep, None) layout), and MindSpore keeps the pipeline's FP32 accumulation buffer whole
    # (SetClonedTensorShapeForOptimizer, gradient_accumulation_shard: False): docs/mindformers.md
    "telechat3_moe/pretrain_telechat3_105b_a4b_4k.yaml": False,
    "general/llm_pretrain_moe_template.yaml": False,
}
#: what the over-budget plans say, and what they would be with gradient_accumulation_shard
OVER_BUDGET_WITH_SHARD = {"telechat3_moe/pretrain_telechat3_105b_a4b_4k.yaml": "14.5 GiB",
                          "general/llm_pretrain_moe_template.yaml": "40.2 GiB"}


def _config(name: str) -> Path:
    if PACKAGE is None:
        pytest.skip("mindformers is not installed (make test installs mindformers 2.0.0; its configs/ are read)")
    path = PACKAGE / name
    if not path.exists():
        pytest.skip(f"{name} is not in the installed mindformers' configs/ (another version?)")
    return path


@pytest.mark.parametrize("name", sorted(PRETRAIN))
def test_every_pretrain_config_plans(name, capsys):
    path = _config(name)
    assert main(["plan", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["capacity"] is not None and out["total"] > 0
    assert out["fits"] is PRETRAIN[name], (name, out["total"] / GiB, out["capacity"] / GiB)
    assert main(["plan", str(path)]) == 0          # the human table too
    text = capsys.readouterr().out
    assert "capacity:" in text
    if not PRETRAIN[name]:     # an honest miss says which term and what would fit
        assert "DOES NOT FIT" in text and "expert_parallel 1: every card holds all" in text
        assert f"gradient_accumulation_shard False; with True the worst stage is {OVER_BUDGET_WITH_SHARD[name]}" \
            in text


def test_every_yaml_in_the_package_plans_or_says_why_in_one_line(capsys):
    if PACKAGE is None:
        pytest.skip("mindformers is not installed")
    for path in sorted(PACKAGE.rglob("*.yaml")):
        code = main(["plan", str(path), "--json"])
        out, err = capsys.readouterr()
        assert code in (0, 2), path
        if code == 2:
            assert len(err.strip().splitlines()) == 1 and str(path) in err, err
            assert "Traceback" not in err
        else:
            assert json.loads(out)["total"] > 0


def test_deepseek_v3_671b_layout(capsys):
    path = _config("deepseek3/pretrain_deepseek3_671b.yaml")
    assert main(["plan", str(path)]) == 0
    assert "MoE 256 experts (8 per card, expert_parallel 32), top-8, 1 shared, first 3 dense; MLA; 1 MTP layer; " \
           "d 4 x t 8 x p 8 x 2 chunks" in capsys.readouterr().out
    r = load_recipe(path)
    assert r.model.moe.num_experts == 256 and r.model.moe.top_k == 8 and r.model.moe.first_dense == 3
    assert r.model.mla is not None and r.model.mtp_layers == 1 and r.parallel.expert_parallel == 32
    assert r.chunk_layers() == ((4,) * 8, (4, 4, 4, 4, 4, 4, 4, 1))
    assert r.train.optimizer_swap and r.model.param_init_type == "float32"
    e = estimate(r)
    assert e.worst.optimizer_states == {"master": 0, "m": 0, "v": 0}            # swapped to host
    assert any("optimizer.swap" in note for note in e.notes)
    # published: 671B main model + 14B MTP module = 685B (DeepSeek-V3 model card); no biases here
    assert model_params(r.model) / 685e9 == pytest.approx(1, abs=0.01)


def test_the_shared_llama2_70b_config_still_fits():
    path = SHARED / "pretrain_llama2_70b.yaml"
    if not path.exists():
        pytest.skip(f"shared MindFormers config not found at {path}")
    e = estimate(load_recipe(path))
    assert e.fits and e.capacity == 56 * GiB


# --- key families, on YAMLs written here ---------------------------------------------------

def _write(tmp_path: Path, data: dict, name: str = "r.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def _mc(**keys) -> dict:
    mc = {"num_layers": 4, "hidden_size": 256, "num_heads": 8, "seq_length": 128, "vocab_size": 1024}
    mc.update(keys)
    return mc


def _recipe(mc: dict, **sections):
    data = {"model": {"model_config": mc}}
    data.update(copy.deepcopy(sections))
    return recipe_from_dict(data, source="t.yaml")


def test_hf_and_legacy_spellings_give_the_same_plan():
    legacy = _recipe(_mc(n_kv_heads=2, param_init_type="float32", layernorm_compute_type="float32"))
    hf = _recipe({"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2,
                  "seq_length": 128, "vocab_size": 1024, "params_dtype": "float32",
                  "layernorm_compute_dtype": "float32"})
    assert dataclasses.replace(hf, source="t.yaml") == legacy
    glm = _recipe({"num_layers": 4, "hidden_size": 256, "num_attention_heads": 8, "multi_query_attention": True,
                   "multi_query_group_num": 2, "seq_length": 128, "padded_vocab_size": 1024,
                   "param_init_type": "float32"})
    assert glm.model.n_kv_heads == 2 and glm.model.vocab_size == 1024


def test_model_type_defaults_fill_missing_keys():
    r = _recipe({"model_type": "qwen3", "seq_length": 256})
    m = r.model
    assert (m.num_layers, m.hidden_size, m.num_heads, m.head_dim, m.vocab_size) == (32, 4096, 32, 128, 151936)
    moe = _recipe({"model_type": "qwen3_moe"}).model
    assert moe.moe.num_experts == 128 and moe.moe.top_k == 8 and moe.n_kv_heads == 4
    ds = _recipe({"model_type": "deepseek_v3", "num_hidden_layers": 8}).model   # the YAML's key wins
    assert ds.num_layers == 8 and ds.mla.kv_lora_rank == 512 and ds.n_kv_heads == ds.num_heads == 128
    assert _recipe({"model_type": "llama"}).model.intermediate_size == 11008
    assert _recipe({"model_type": "telechat3"}).model.vocab_size == 131072


def test_qwen3_head_dim_wider_than_hidden_over_heads():
    r = _recipe(_mc(hidden_size=5120, num_heads=64, n_kv_heads=8, head_dim=128))
    assert r.model.head_dim == 128
    assert attention_params(r.model) == 2 * 5120 * 64 * 128 + 2 * 5120 * 8 * 128


def test_moe_experts_expert_parallel_dense_first_and_top_k():
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, n_shared_experts=1,
               first_k_dense_replace=1, intermediate_size=512)
    r = _recipe(_mc(**moe), parallel_config={"data_parallel": 4})
    split = stage_param_split(r)[0]
    expert = 3 * 256 * 64
    assert split.experts == 3 * 8 * expert                      # 3 MoE layers (layer 0 is dense) x 8 experts
    ep = _recipe(_mc(**moe), parallel_config={"data_parallel": 4, "expert_parallel": 4})
    assert stage_param_split(ep)[0].experts == split.experts // 4
    assert stage_param_split(ep)[0].dense == split.dense
    # routed activations and the all-to-all buffers grow with top-k
    k4 = _recipe(_mc(**{**moe, "num_experts_per_tok": 4}), parallel_config={"data_parallel": 4})
    shape = dict(seq=128, micro_batch=1)
    assert layer_activation_bytes(k4.model, **shape, moe_layer=True) > layer_activation_bytes(r.model, **shape,
                                                                                              moe_layer=True)
    a2a = estimate(r).worst.communication["alltoall_buffers"]
    assert a2a == 2 * 128 * 2 * 256 * 2 and estimate(k4).worst.communication["alltoall_buffers"] == 2 * a2a
    with pytest.raises(InputError, match="expert_parallel"):
        _recipe(_mc(**moe), parallel_config={"data_parallel": 4, "expert_parallel": 3})


def test_published_moe_parameter_counts():
    # Qwen3-30B-A3B: 30.5B parameters (Qwen3 technical report); our count has no biases
    qwen = _recipe({"model_type": "qwen3_moe", "num_hidden_layers": 48}).model
    assert model_params(qwen) / 30.5e9 == pytest.approx(1, abs=0.02)


def test_mtp_layers_add_a_layer_an_embedding_copy_and_a_second_logits_on_the_last_stage():
    base = dict(parallel_config={"pipeline_stage": 2, "micro_batch_num": 2})
    plain = _recipe(_mc(), **base)
    mtp = _recipe(_mc(num_nextn_predict_layers=1), **base)
    first, last = (stage_param_split(mtp)[i].total - stage_param_split(plain)[i].total for i in (0, 1))
    assert first == 0 and last > 1024 * 256          # a layer + 2h x h + the embedding copy
    assert logits_bytes(mtp) == 2 * logits_bytes(plain)


def test_last_stage_lm_head_logits_and_loss_in_fp32():
    r = _recipe(_mc(vocab_size=32000, seq_length=512), parallel_config={"model_parallel": 2})
    assert logits_bytes(r) == 512 * 32000 // 2 * (2 + 4 + 4)
    assert stage_activation_bytes(r, 0).bytes > logits_bytes(r)


def test_interleaved_offsets_recompute_lists_and_in_flight():
    r = _recipe(_mc(num_layers=10, offset=[[1, 0], [0, 1]], pp_interleave_num=2),
                parallel_config={"pipeline_stage": 2, "micro_batch_num": 4},
                recompute_config={"recompute": [[1, 0], [2, 0]]})
    assert r.chunk_layers() == ((3, 2), (2, 3)) and r.stage_layers() == [5, 5]
    assert r.chunk_first_layer(0, 1) == 5 and r.chunk_first_layer(1, 1) == 7
    # recompute [[1, 0], [2, 0]]: stage 0 recomputes 1 layer of chunk 0 and 2 of chunk 1
    assert stage_activation_bytes(r, 0).recomputed_layers == 3
    # Narayanan et al.: the first stage holds 1 + (p - 1)/(p v) times plain 1F1B's chunk forwards
    assert sum(in_flight_chunks(0, 8, 64, 2)) == 2 * 8 * (1 + 7 / 16)
    with pytest.raises(InputError, match=r"sum to num_layers % \(pipeline_stage x pp_interleave_num\) = 10 % 4 = 2"):
        _recipe(_mc(num_layers=10, offset=[[1, 1], [1, 1]], pp_interleave_num=2),
                parallel_config={"pipeline_stage": 2, "micro_batch_num": 4})
    with pytest.raises(InputError, match=r"recompute_config\.recompute\[1\]"):
        _recipe(_mc(num_layers=8, pp_interleave_num=2), parallel_config={"pipeline_stage": 2, "micro_batch_num": 2},
                recompute_config={"recompute": [[1, 0], [2]]})


def test_parallel_optimizer_shards_weights_and_states_but_not_the_pipeline_accumulation():
    par = {"data_parallel": 4, "pipeline_stage": 2, "micro_batch_num": 2}
    off = estimate(_recipe(_mc(), parallel_config=par)).stages[0].regions
    on = estimate(_recipe(_mc(), parallel_config=par, parallel={"enable_parallel_optimizer": True})).stages[0].regions
    assert on["parameters"] == pytest.approx(off["parameters"] / 4, abs=1)
    assert on["optimizer"] == pytest.approx(off["optimizer"] / 4, abs=3)
    assert on["gradients"] == off["gradients"]                       # accu_grads stay whole
    shard = estimate(_recipe(_mc(), parallel_config=par, parallel={
        "enable_parallel_optimizer": True, "parallel_optimizer_config": {"gradient_accumulation_shard": True}}))
    assert shard.stages[0].regions["gradients"] == pytest.approx(off["gradients"] / 4, abs=1)


def test_pynative_layout_and_fsdp(tmp_path):
    data = {"training": {"local_batch_size": 1, "global_batch_size": 8},
            "parallelism": {"data_parallel_shard": -1, "data_parallel_shard_strategy": "optim_grads_params",
                            "tensor_parallel": 1, "pipeline_parallel": 1},
            "model": {"model_type": "qwen3", "num_hidden_layers": 2, "seq_length": 256}}
    r = load_recipe(_write(tmp_path, data))
    assert r.parallel.data_parallel == 8 and r.memopt.zero_stage == 3 and r.model.num_layers == 2
    assert r.model.use_flash_attention and r.capacity == 59 * GiB     # MindFormers' PyNative defaults


def test_pretrained_model_dir_config_json_is_read_and_yaml_keys_win(tmp_path):
    hf = {"model_type": "qwen3", "num_hidden_layers": 6, "hidden_size": 512, "num_attention_heads": 8,
          "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 2048, "intermediate_size": 1024}
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(hf), encoding="utf-8")
    path = _write(tmp_path, {"pretrained_model_dir": "model", "model": {"model_config": {"seq_length": 64,
                                                                                         "num_hidden_layers": 3}}})
    m = load_recipe(path).model
    assert (m.num_layers, m.hidden_size, m.n_kv_heads, m.seq_length) == (3, 512, 2, 64)
    missing = _write(tmp_path, {"pretrained_model_dir": "nowhere", "model": {"model_config": {"num_experts": 8}}},
                     "t2.yaml")
    r = load_recipe(missing)
    assert r.model.moe is not None and any("qwen3_moe defaults" in n for n in estimate(r).notes)


def test_predict_multimodal_and_encoder_decoder_configs_get_one_line_reasons(tmp_path, capsys):
    cases = {"run_mode is 'predict'": {"run_mode": "predict", "model": {"model_config": _mc()}},
             "multi-modal": {"model": {"model_config": {"llm_model": {"model_config": _mc()}}}},
             "encoder-decoder": {"model": {"model_config": {"encoder_layers": 4, "d_model": 64}}}}
    for i, (reason, data) in enumerate(cases.items()):
        assert main(["plan", str(_write(tmp_path, data, f"c{i}.yaml"))]) == 2
        err = capsys.readouterr().err
        assert reason in err and len(err.strip().splitlines()) == 1


def test_a_typo_in_a_required_key_says_did_you_mean(tmp_path, capsys):
    mc = _mc()
    mc["num_layerz"] = mc.pop("num_layers")
    assert main(["plan", str(_write(tmp_path, {"model": {"model_config": mc}}))]) == 2
    err = capsys.readouterr().err
    assert "model.model_config.num_layerz: unknown key; did you mean num_layers?" in err
    # a near miss of a key we read is refused in every MindFormers section we read, never ignored
    for section, typo, right in (("parallel_config", "pipline_stage", "pipeline_stage"),
                                 ("recompute_config", "select_recompte", "select_recompute"),
                                 ("context", "max_device_memroy", "max_device_memory")):
        data = {"model": {"model_config": _mc()}, section: {typo: 2}}
        assert main(["plan", str(_write(tmp_path, data, f"{section}.yaml"))]) == 2
        assert f"{section}.{typo}: unknown key; did you mean {right}?" in capsys.readouterr().err
    # a missing key with no near miss still says which key, and its other spellings
    mc = _mc()
    del mc["num_layers"]
    assert main(["plan", str(_write(tmp_path, {"model": {"model_config": mc}}, "m.yaml"))]) == 2
    assert "num_layers: missing required key (or num_hidden_layers" in capsys.readouterr().err


def test_simulate_accepts_a_moe_config(tmp_path, capsys):
    data = {"model": {"model_config": _mc(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                          use_flash_attention=True)},
            "parallel_config": {"data_parallel": 2, "expert_parallel": 2},
            "context": {"max_device_memory": "1GB"},
            "memopt": {"workspace": "8MiB", "workload": {"steps": 3}}}
    assert main(["simulate", str(_write(tmp_path, data)), "--steps", "3", "--json"]) == 0


# --- simulate: MoE routing, a dynamic-shape source ------------------------------------------

def _moe_recipe(**workload):
    return _recipe(_mc(num_experts=16, num_experts_per_tok=2, moe_intermediate_size=64, first_k_dense_replace=1),
                   parallel_config={"data_parallel": 4, "expert_parallel": 4},
                   memopt={"workload": workload})


def _alltoall_sizes(recipe, steps: int, seed: int = 1, tags=("alltoall", "expert_activation")):
    from ms_memopt.workload.step import StepWorkload
    from ms_memopt.simulation.spec import spec_from_recipe
    gen = StepWorkload(spec_from_recipe(recipe), seed=seed)
    gen.prologue()
    return [[e.size for e in gen.step(i) if e.action == "alloc" and e.tag in tags] for i in range(1, steps + 1)]


def test_moe_buffers_vary_step_to_step_around_the_balanced_load():
    from ms_memopt.analysis.estimate import alltoall_bytes
    from ms_memopt.simulation.spec import spec_from_recipe
    r = _moe_recipe()
    spec = spec_from_recipe(r)
    assert spec.moe_layers == (1, 2, 3) and spec.moe_local_experts == 4 and spec.moe_load_cv == 0.2
    assert spec.alltoall_bytes == alltoall_bytes(r)
    sizes = _alltoall_sizes(r, 60)
    assert len({tuple(s) for s in sizes}) == 60                       # every step differs
    buffers = [x for s in _alltoall_sizes(r, 60, tags=("alltoall",)) for x in s]
    mean = sum(buffers) / len(buffers)
    assert mean == pytest.approx(spec.alltoall_bytes / 2, rel=0.05)   # the plan's figure is the mean
    assert _alltoall_sizes(r, 5) == _alltoall_sizes(r, 5)             # a seed fixes the stream
    steady = _alltoall_sizes(_moe_recipe(moe_load_cv=0), 5)
    assert len({tuple(s) for s in steady}) == 1                       # balanced: every step the same


def test_dense_recipes_get_no_moe_events():
    from ms_memopt.simulation.spec import spec_from_recipe
    spec = spec_from_recipe(_recipe(_mc()))
    assert spec.moe_layers == () and _alltoall_sizes(_recipe(_mc()), 2) == [[], []]


def test_bloom_176b_parameters_and_peak_against_bigscience():
    """BLOOM-176B as BigScience trained it (BLOOM paper, arXiv 2211.05100; the 176B model page):
    70 layers, h 14336, 112 heads, s 2048, vocabulary 250,880, tied embeddings, GeLU FFN 4h,
    384 A100 80GB as TP 4 x PP 12 x DP 8, micro-batch 2, ZeRO-1, BF16 with FP32 gradient
    accumulation, full activation checkpointing; published: 176,247M parameters, and "one copy
    of the model takes 48 GPUs (using 60 GB of memory on each GPU)"."""
    r = _recipe({"num_layers": 70, "hidden_size": 14336, "num_heads": 112, "seq_length": 2048,
                 "vocab_size": 250880, "hidden_act": "gelu", "intermediate_size": 4 * 14336,
                 "compute_dtype": "bfloat16", "tie_word_embeddings": True},
                parallel_config={"data_parallel": 8, "model_parallel": 4, "pipeline_stage": 12,
                                 "micro_batch_num": 128},
                runner_config={"batch_size": 2}, recompute_config={"recompute": True},
                memopt={"zero_stage": 1, "grad_dtype": "float32", "device": {"hbm": "80GiB"}})
    assert model_params(r.model) / 176_247e6 == pytest.approx(1, abs=0.001)
    e = estimate(r)
    assert e.worst.stage == 0 and e.fits
    assert 0.85 <= e.total / 60e9 <= 1.05        # 60.0 GB planned (55.9 GiB)


# --- MindSpore's parallel optimizer, as its source does it (docs/mindformers.md) -------------

def test_optimizer_weight_shard_size_caps_the_sharding_when_it_divides_the_replicas():
    from ms_memopt.analysis.estimate import optimizer_shard_ways
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64)
    par = {"data_parallel": 8, "model_parallel": 2, "expert_parallel": 2}

    def ways(size):
        poc = {} if size is None else {"optimizer_weight_shard_size": size}
        return optimizer_shard_ways(_recipe(_mc(**moe), parallel_config=par, parallel={
            "enable_parallel_optimizer": True, "parallel_optimizer_config": poc}))
    assert ways(None) == ways(-1) == (8, 8)          # experts: 8 x 2 / 2 replicas
    assert ways(4) == (4, 4) and ways(3) == (8, 8)   # 3 divides neither: not effective
    r = load_recipe(_config("deepseek3/pretrain_deepseek3_671b.yaml"))
    assert r.parallel.optimizer_weight_shard_size == 256 and optimizer_shard_ways(r) == (4, 1)


def test_optimizer_level2_shards_the_accumulation_buffer_like_gradient_accumulation_shard():
    par = {"data_parallel": 4, "pipeline_stage": 2, "micro_batch_num": 2}
    regions = [estimate(_recipe(_mc(), parallel_config=par, parallel={
        "enable_parallel_optimizer": True, "parallel_optimizer_config": poc})).stages[0].regions["gradients"]
        for poc in ({}, {"optimizer_level": "level2"}, {"gradient_accumulation_shard": True})]
    assert regions[1] == regions[2] == pytest.approx(regions[0] / 4, abs=1)
    with pytest.raises(InputError, match="optimizer_level"):
        _recipe(_mc(), parallel={"parallel_optimizer_config": {"optimizer_level": "level9"}})


def test_the_parallel_optimizer_gathers_a_layer_in_the_compute_dtype_under_pipeline():
    from ms_memopt.analysis.estimate import gathered_layer_bytes, layer_params
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, intermediate_size=512,
               compute_dtype="bfloat16", param_init_type="float32")
    par = {"data_parallel": 4, "pipeline_stage": 2, "micro_batch_num": 2}
    po = {"enable_parallel_optimizer": True}
    assert gathered_layer_bytes(_recipe(_mc(**moe), parallel_config=par)) == 0
    r = _recipe(_mc(**moe), parallel_config=par, parallel=po)
    assert gathered_layer_bytes(r) == 2 * max(layer_params(r.model, 0), layer_params(r.model, 1))
    flat = _recipe(_mc(**moe), parallel_config={"data_parallel": 4}, parallel=po)    # gather fp32, then cast
    assert gathered_layer_bytes(flat) == 3 * gathered_layer_bytes(r)
    # experts split by expert_parallel 4 over data_parallel 4 have no replica: not gathered
    ep = _recipe(_mc(**moe), parallel_config={**par, "expert_parallel": 4}, parallel=po)
    assert gathered_layer_bytes(ep) == 2 * (layer_params(ep.model, 0) - 8 * 3 * 256 * 64)
    assert estimate(r).worst.communication["allgather_bucket"] >= gathered_layer_bytes(r)
    telechat = load_recipe(_config("telechat3_moe/pretrain_telechat3_105b_a4b_4k.yaml"))
    assert estimate(telechat).worst.communication["allgather_bucket"] == gathered_layer_bytes(telechat)
    assert gathered_layer_bytes(telechat) / GiB == pytest.approx(4.23, abs=0.01)     # 192 experts, BF16


def test_pool_mode_sizes_the_moe_buffers_from_the_routed_tokens(tmp_path, capsys):
    """Pool mode's communication region holds the all-to-all buffers and its workspace the kept
    routed activations, at a load four deviations above the balanced one: a MoE job whose
    routing varies step to step (cv 0.5) runs 40 steps without a pool-mode OOM."""
    from ms_memopt.simulation.pool_sizing import moe_load_headroom, region_sizes_for_workload
    from ms_memopt.simulation.spec import spec_from_recipe
    mc = _mc(seq_length=1024, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256,
             first_k_dense_replace=1, use_flash_attention=True)
    data = {"model": {"model_config": mc}, "parallel_config": {"data_parallel": 4, "expert_parallel": 4},
            "context": {"max_device_memory": "2GB"},
            "memopt": {"workspace": "8MiB", "workload": {"steps": 40, "moe_load_cv": 0.5}}}
    spec = spec_from_recipe(recipe_from_dict(copy.deepcopy(data), source="t.yaml"))
    flat = dataclasses.replace(spec, moe_layers=())
    assert 1 < moe_load_headroom(spec) < spec.moe_experts / spec.moe_local_experts
    extra = region_sizes_for_workload(spec)["communication"] - region_sizes_for_workload(flat)["communication"]
    assert extra >= spec.alltoall_bytes * moe_load_headroom(spec) - 512
    assert main(["simulate", str(_write(tmp_path, data)), "--steps", "40", "--policy", "pool", "--json"]) == 0
    first = json.loads(capsys.readouterr().out)["policies"]["pool"]["first_rank"]
    assert first["oom_step"] is None, first["oom_tag"]
