"""Every decoder-only causal LM of the installed transformers through HFCausalLM: works, refused, or not a
decoder-only text model, with the reason, as a markdown table for docs/hf-models.md.

For each model type of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` a tiny random model is built from its own
Config class (`tiny_config`: 2 layers, width 32, vocabulary 256, every dropout 0; nothing downloaded) and

1. types that are not decoder-only text models (encoder-decoder, multimodal-only, encoders used as
   decoders, ...) are skipped, saying why;
2. ``HFCausalLM(model)`` and its dry run (structure, side inputs, the chain's logits against the model's at
   its weights and at enlarged logits) either accept it or refuse it with their message;
3. a model whose training forward draws random numbers although every dropout is 0 (Phi-MoE's router
   jitter, ...) is listed as random by design: no run can equal another's;
4. the rest train 2 optimizer steps (N=2 micro-batches of 2 x 16 tokens, SGD) under
   ``Trainer(devices=1, strategy=PACIStrategy(pipeline_stages=2, schedule="1f1b_flush"))`` and under plain
   one-device Lightning; the table gives the largest weight difference after training ("works" at <= 1e-5).

    python -m benchmarks.hf_zoo                     # the whole list: ~3.5 minutes on 2 shared cores
    python -m benchmarks.hf_zoo --types llama opt   # some of them
    python -m benchmarks.hf_zoo --markdown benchmarks/results/hf_zoo.md --json benchmarks/results/hf_zoo.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

VOCAB = 256
BLOCK = 16

# The sizes of a tiny model, under the names Config classes use (aliases through each class's attribute_map);
# only the ones a Config class has are passed.
SIZES: dict[str, Any] = dict(
    num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
    head_dim=8, vocab_size=VOCAB, max_position_embeddings=64, n_positions=64, n_ctx=64,
    ffn_dim=64, n_inner=64, d_ff=64, ffn_hidden_size=64,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_local_experts=4,
    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, qk_head_dim=16,
    bos_token_id=0, eos_token_id=0, pad_token_id=0, sliding_window=8, rotary_dim=8, hidden_size_global=32,
)  # fmt: skip


def tiny_config(model_type: str, **overrides: Any) -> Any:
    """``model_type``'s Config with the tiny `SIZES` it has, every dropout 0, per-layer lists cut to 2 layers,
    every sub-config (Dbrx's attention, a composite's text and vision parts) made tiny the same way, and
    ``overrides`` last."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return _tiny(CONFIG_MAPPING[model_type], overrides)


def _tiny(cls: type, overrides: dict[str, Any]) -> Any:
    try:
        default = cls()
    except Exception:  # noqa: BLE001 - defaults its own validator rejects (Gemma-4 assistant): read with the overrides
        default = cls(**overrides)
    values = {k: v for k, v in SIZES.items() if _has(default, k)}
    if "kv_lora_rank" in values:  # multi-head latent attention: as many key heads as query heads
        values["num_key_value_heads"] = values["num_attention_heads"]
    depth = getattr(default, "num_hidden_layers", None)
    for key, value in default.to_dict().items():
        if ("dropout" in key or "pdrop" in key or key.endswith("_drop")) and isinstance(value, float):
            values[key] = 0.0
        elif isinstance(value, list) and depth and len(value) == depth and depth != SIZES["num_hidden_layers"]:
            values[key] = value[: SIZES["num_hidden_layers"]]  # layer_types and other per-layer lists
    for name in getattr(cls, "sub_configs", {}):
        sub = getattr(default, name, None)
        if name not in overrides and sub is not None and hasattr(sub, "to_dict"):
            # Its own class (Fuyu's text_config is whatever AutoConfig made), with its type's OVERRIDES.
            values[name] = _tiny(type(sub), OVERRIDES.get(getattr(sub, "model_type", ""), {}))
    values.update(overrides)
    for _ in range(len(values) + 1):  # one try with every value, then one per value dropped (none: MPT's attention)
        try:
            return cls(**values)
        except (AttributeError, NotImplementedError) as err:
            # A derived size (a property without a setter, XLNet's refusing max_position_embeddings): let the class
            # derive it.
            named = [k for k in values if f"'{k}'" in str(err)]
            key = next(iter(named or [k for k in values if isinstance(getattr(cls, k, None), property)]), None)
            if key is None or key in overrides:
                raise
            del values[key]
    raise ValueError(
        f"{cls.__name__} still refuses {sorted(values)} after dropping every derived size it named; add the sizes "
        "it needs to OVERRIDES"
    )


def _text_config(config: Any) -> Any:
    """``config``'s text decoder config (itself for a plain one), or None where the class cannot say."""
    try:
        return config.get_text_config()
    except Exception:  # noqa: BLE001 - a config whose text part is ambiguous: treated as plain
        return None


def _has(config: Any, key: str) -> bool:
    try:
        return hasattr(config, key)
    except Exception:  # noqa: BLE001 - e.g. a per-layer attribute a composite config refuses to answer globally
        return False


# Per-type sizes the generic ones get wrong (the model type's own constraints, each named by the check its Config
# class makes), and settings that exercise what HFCausalLM must reproduce (a logit scale that is not 1). Hybrid
# models get one layer of each kind, so both kinds are split and trained.
_MAMBA = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16)  # heads x d_head = 2 x 32
# fmt: off
OVERRIDES: dict[str, dict[str, Any]] = {
    "granite": dict(logits_scaling=4.0, embedding_multiplier=2.0, residual_multiplier=0.5),
    "cohere": dict(logit_scale=0.25),
    "bamba": dict(_MAMBA, attn_layer_indices=[1]),
    "granitemoehybrid": dict(_MAMBA, layer_types=["mamba", "attention"]),
    "mamba2": dict(num_heads=4, head_dim=16, state_size=16, n_groups=1, chunk_size=16),  # num_heads x head_dim = 2 x 32
    "zaya": dict(num_experts_per_tok=1),  # "ZAYA currently supports num_experts_per_tok=1 only"
    # "NVFP4 rounding of keys and values needs a `head_dim` that is a multiple of 16" (2 heads x 16 = 32), and
    # "`index_num_heads` must be between 1 and" the heads.
    "kolibri1_1": dict(num_attention_heads=2, num_key_value_heads=1, head_dim=16, index_num_heads=1),
    "olmo_hybrid": dict(layer_types=["linear_attention", "full_attention"]),  # needs an attention layer
    # Per-layer input tables of the vocabulary's size (262,144 rows by default), key/value sharing across the last
    # 15 layers by default: none of 2 layers here, so every layer type producing a cache also uses one.
    "gemma3n_text": dict(
        layer_types=["sliding_attention", "full_attention"], num_kv_shared_layers=0, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB, laurel_rank=8,
    ),
    "gemma4_text": dict(
        layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB,
    ),
    "xlnet": dict(d_head=8),  # d_model // n_head
    # Built as a decoder (ReformerModelWithLMHead asks for is_decoder=True), one local and one LSH layer.
    "reformer": dict(
        is_decoder=True, attn_layers=["local", "lsh"], axial_pos_shape=[4, 4], axial_pos_embds_dim=[16, 16],
        local_attn_chunk_length=4, lsh_attn_chunk_length=4, num_buckets=4,
    ),  # axial positions multiply to the 16-token blocks and sum to the width
    "blt": dict(encoder_hash_byte_group_vocab=64),  # the byte n-gram hash tables: 500,002 rows by default
    # Its modeling code reads attn_config.rope_theta, which DbrxAttentionConfig does not define (transformers 5.24).
    # Its attention clamps by clip_qkv, which defaults to None (torch.clamp refuses no bound): DBRX's own value, 8.
    # Its FFN sub-config copies d_model before the hidden_size alias sets it: d_model is given by its own name.
    "dbrx": dict(
        d_model=32, attn_config=dict(kv_n_heads=2, rope_theta=10_000.0, clip_qkv=8.0),
        ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2),
    ),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),  # its default of None does not build
    # Its rotary embedding looks up rope_parameters by layer type; the default has none keyed so.
    "cohere_compass_text": dict(rope_parameters={"full_attention": dict(rope_type="default", rope_theta=10_000.0)}),
    # Its linear attention defaults to 32 heads of 128 (4096 wide at any hidden size), which the pure-PyTorch
    # delta-rule fallback runs in minutes on a CPU: 4 heads of 8 here, and one layer of each kind.
    "kimi_linear": dict(linear_num_heads=4, linear_head_dim=8, layer_types=["linear_attention", "full_attention"]),
    "dots3_note_text": dict(
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, index_head_dim=16,
        index_n_heads=4, index_topk=8, shared_experts_intermediate_size=32,
    ),  # sizes it reads per layer, which the generic look-up does not see
}
# fmt: on


def build(model_type: str, seed: int = 0, **overrides: Any) -> Any:
    """A tiny random ``model_type`` causal LM (`tiny_config`, `OVERRIDES`, then ``overrides``), seeded."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type, **{**OVERRIDES.get(model_type, {}), **overrides})
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def batches(n: int = 4, rows: int = 2, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` micro-batches of ``(input_ids, next tokens)``, ``rows`` x `BLOCK` random tokens."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n, rows, BLOCK + 1), generator=gen)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def sgd_module(model: Any) -> Any:
    """``HFCausalLM(model)`` with plain SGD + momentum (the exact comparison's optimizer: AdamW magnifies rounding)."""
    from lit_efficient.models import HFCausalLM

    class SGDLM(HFCausalLM):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)

    return SGDLM(model)


def fit(module: Any, strategy: Any, devices: int, data: list, accumulate: int = 2) -> dict[str, torch.Tensor]:
    """Train ``module`` over ``data`` (one epoch, ``accumulate`` micro-batches a step); its weights after."""
    import lightning as L

    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_epochs=1, accumulate_grad_batches=accumulate,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def random_by_design(model: Any) -> bool:
    """Whether ``model``'s training forward and backward give two different results for one input (with every
    dropout 0): router jitter, Gumbel sampling and other draws no two runs can share."""
    ids = torch.cat([x for x, _ in batches()])  # the training data: a draw may matter on some tokens only
    was_training = model.training
    model.train()
    runs = []
    try:
        for seed in (1, 2):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(seed)
            logits = model(input_ids=ids, use_cache=False).logits
            logits.float().square().mean().backward()
            runs.append([logits.detach(), *(p.grad.clone() for p in model.parameters() if p.grad is not None)])
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return any(not torch.equal(a, b) for a, b in zip(*runs, strict=True))


def flush_in_one_process(model_type: str, **overrides: Any) -> float:
    """Max weight difference after 2 steps: ``PACIStrategy(pipeline_stages=2, schedule="1f1b_flush")`` on one
    device against plain one-device Lightning, from the same tiny model and data."""
    from lit_efficient import PACIStrategy

    data = batches()
    start = build(model_type, **overrides)
    single = fit(sgd_module(build(model_type, **overrides)), "auto", 1, data)
    strategy = PACIStrategy(pipeline_stages=2, schedule="1f1b_flush")
    piped = fit(sgd_module(build(model_type, **overrides)), strategy, 1, data)
    moved = max_diff(single, {f"model.{k}": v for k, v in start.state_dict().items()})
    if moved < 1e-4:
        raise AssertionError(f"{model_type}: training did not move the weights ({moved:.3g})")
    return max_diff(piped, single)


MAX_PARAMS = 10_000_000  # a "tiny" model above this kept sub-configs at full size: listed as such, not trained


def skip_reason(model_type: str, class_name: str) -> str | None:
    """Why ``model_type`` is not a decoder-only text model HFCausalLM is for, or None. Each reason is a rule
    read from the class or its config, not a list of names."""
    import inspect

    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if class_name.endswith("ForConditionalGeneration"):
        return f"multimodal: its causal-LM class is {class_name} (a vision/audio tower beside the text decoder)"
    forward = getattr(getattr(transformers, class_name, None), "forward", None)
    if forward is not None and "shared_kv_states" in inspect.signature(forward).parameters:
        return (
            "a draft model for speculative decoding: its forward takes the main model's embeddings and key/value "
            "states (shared_kv_states), so it does not train on tokens alone"
        )
    config = AutoConfig.for_model(model_type)
    if getattr(config, "is_encoder_decoder", False):
        return "the decoder half of an encoder-decoder model (its config is encoder-decoder)"
    if getattr(config, "is_decoder", None) is False and hasattr(config, "add_cross_attention"):
        # BERT, RoBERTa, ELECTRA, RoFormer, X-MOD, ...: a bidirectional encoder unless built with is_decoder=True.
        return "an encoder (BERT family) run as a decoder: its config's is_decoder defaults to False"
    text = _text_config(config)
    text_type = getattr(text, "model_type", model_type)
    if text is not config and MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(text_type) == class_name:
        return (
            f"its config is the composite (text + {', '.join(n for n in config.sub_configs if n != 'text_config')}) "
            f"one; {class_name} is built from its text part, the row of {text_type}"
        )
    return None


def classify(model_type: str, class_name: str, timeout: int = 300) -> dict[str, Any]:
    """One row of the table for ``model_type``: status, max diff, reason, seconds."""
    import signal

    row: dict[str, Any] = {"model_type": model_type, "class": class_name, "max_diff": None, "reason": ""}
    start = time.monotonic()

    def alarm(*_: Any) -> None:
        raise TimeoutError(f"over {timeout} s")

    signal.signal(signal.SIGALRM, alarm)
    signal.alarm(timeout)
    try:
        row = _classify(row)
    except TimeoutError as err:
        row = dict(row, status="timed out", reason=str(err))
    finally:
        signal.alarm(0)
    return dict(row, seconds=round(time.monotonic() - start, 1))


def _classify(row: dict[str, Any]) -> dict[str, Any]:
    from lit_efficient.models import HFCausalLM

    model_type, class_name = row["model_type"], row["class"]
    try:
        reason = skip_reason(model_type, class_name)
    except Exception as err:  # noqa: BLE001 - its default config does not validate
        return dict(row, status="no tiny model", reason=f"{type(err).__name__}: {_line(err)}")
    if reason is not None:
        return dict(row, status="skipped", reason=reason)
    try:
        config = tiny_config(model_type, **OVERRIDES.get(model_type, {}))
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        if size > MAX_PARAMS:
            return dict(row, status="no tiny model", reason=f"{size:,} parameters at the generic tiny sizes")
        model = build(model_type)
        ids = batches(1)[0][0]
        model(input_ids=ids, use_cache=False)
    except Exception as err:  # noqa: BLE001 - the table says what failed
        return dict(row, status="no tiny model", reason=f"{type(err).__name__}: {_line(err)}")
    try:
        HFCausalLM(model).pipeline_layers()
    except Exception as err:  # noqa: BLE001
        return dict(row, status="refused", reason=f"{type(err).__name__}: {_line(err)}")
    if random_by_design(model):
        return dict(
            row,
            status="random by design",
            reason="its training forward draws random numbers with every dropout 0 (e.g. router jitter)",
        )
    try:
        diff = flush_in_one_process(model_type)
    except Exception as err:  # noqa: BLE001
        return dict(row, status="fails in training", reason=f"{type(err).__name__}: {_line(err)}")
    return dict(row, status="works" if diff <= 1e-5 else "differs", max_diff=diff)


def _line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= 400 else text[:397] + "..."


def markdown(rows: list[dict[str, Any]]) -> str:
    """docs/hf-models.md's table: one row per model type, the counts first."""
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    head = ", ".join(f"{n} {k}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    lines = [f"{len(rows)} model types: {head}.", "", "| model type | class | result | max diff | reason |",
             "|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        diff = "" if r["max_diff"] is None else f"{r['max_diff']:.1e}"
        reason = r["reason"].replace("|", "\\|")
        lines.append(f"| {r['model_type']} | {r['class']} | {r['status']} | {diff} | {reason} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", nargs="*", help="model types (default: every one in the mapping)")
    parser.add_argument("--markdown", default="benchmarks/results/hf_zoo.md")
    parser.add_argument("--json", default="benchmarks/results/hf_zoo.json")
    parser.add_argument("--update", action="store_true", help="replace only these types' rows in --json's table")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    types = args.types or list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    # With --update, a type's old row stays until its new one replaces it: a stopped run loses no row.
    rows = json.loads(Path(args.json).read_text())["rows"] if args.update else []
    for model_type in types:
        with contextlib.redirect_stdout(io.StringIO()):
            row = classify(model_type, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
        rows = [r for r in rows if r["model_type"] != model_type] + [row]
        print(
            f"{model_type:28s} {row['status']:18s} {row['max_diff']} {row['seconds']}s {row['reason'][:150]}",
            file=sys.stderr,
            flush=True,
        )
        with open(args.json, "w") as f:  # after every row: a long run that is stopped keeps what it has
            json.dump({"transformers": transformers.__version__, "torch": torch.__version__, "rows": rows}, f, indent=1)
    order = list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    rows.sort(key=lambda r: order.index(r["model_type"]))
    with open(args.markdown, "w") as f:
        f.write(f"transformers {transformers.__version__}, torch {torch.__version__}. " + markdown(rows))


if __name__ == "__main__":
    main()
