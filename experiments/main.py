"""Main job: run the configured systems on the same prompts, print a summary table, write result CSVs.

    python -m experiments.main                       # tiny default on CPU
    python -m experiments.main model=dsv2 mem=low    # real checkpoint (or model.weights=synthetic)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

import specter
from experiments import records
from experiments.settings import model_choice, results_dir, specter_config
from experiments.systems import build_system
from specter.errors import SpecterError

WARMUP_TOKENS = 4
CONF = Path(__file__).resolve().parent.parent / "conf"
CHECKED_GROUPS = ("model", "mem", "dataset", "experiment")


def check_group_choices(argv: list[str]) -> None:
    """One-line error for `group=option` overrides naming an option file that does not exist."""
    for arg in argv:
        group, sep, option = arg.partition("=")
        if sep and group in CHECKED_GROUPS and (CONF / group).is_dir() and not (CONF / group / f"{option}.yaml").is_file():
            known = ", ".join(sorted(p.stem for p in (CONF / group).glob("*.yaml")))
            raise SpecterError(f"unknown {group} {option!r}; known: {known}")


def prompt_ids(model: specter.HybridMoEModel, texts: list[str], prefix_tokens: int) -> list:
    """Tokenize each prompt and cut it to its first `prefix_tokens` tokens; [1, T] tensors."""
    import torch

    if not texts:
        raise SpecterError("the dataset has no prompts")
    return [torch.tensor([model.tokenizer(t)["input_ids"][:prefix_tokens]]) for t in texts]


def run(cfg: DictConfig) -> Path:
    """Run the main job; returns the results directory it wrote."""
    choice = model_choice(cfg)
    config = specter_config(cfg, choice.spec)
    out_dir = results_dir(cfg, choice.spec)
    model = specter.load_model(choice.source, synthetic=choice.synthetic, device=choice.device,
                               dtype=choice.dtype, seed=int(cfg.seed), draft=choice.draft)
    prompts = prompt_ids(model, list(cfg.dataset.prompts)[: cfg.num_prompts], cfg.prefix_tokens)
    systems = [build_system(name, model, config) for name in cfg.systems]
    rows = run_systems(systems, prompts, cfg.max_new_tokens, strict=cfg.strict)
    out_dir.mkdir(parents=True, exist_ok=False)
    summary = records.write_tables(out_dir, rows)
    (out_dir / "run.json").write_text(json.dumps(
        {"config": OmegaConf.to_container(cfg, resolve=True), "specter_version": specter.__version__,
         "quantizer": model.quantizer, "device": str(model.device), "dtype": str(model.dtype)}, indent=2))
    print(f"\n{choice.spec.name} ({'synthetic' if choice.synthetic else 'checkpoint'}), K={config.k}, "
          f"{config.resident_experts_per_layer} resident experts/layer, {len(prompts)} prompts x "
          f"{cfg.max_new_tokens} tokens on {model.device}")
    print(records.format_table(summary))
    print(f"results: {out_dir}")
    return out_dir


def run_systems(systems: list, prompts: list, max_new_tokens: int, strict: bool) -> list[dict]:
    """Every system on every prompt after one warm-up each; rows compare tokens with target-only."""
    rows, runnable = [], []
    for system in systems:
        ok, reason = system.available()
        if ok:
            system.generate(prompts[0], WARMUP_TOKENS)  # warm-up, excluded from the records
            runnable.append(system)
        else:
            rows.append(records.unavailable(system.name, reason))
    with tqdm(total=len(prompts) * len(runnable), desc="decoding", unit="run", file=sys.stderr) as bar:
        for i, ids in enumerate(prompts):
            results = {}
            for system in runnable:
                results[system.name] = system.generate(ids, max_new_tokens)
                bar.update()
            reference = results["target_only"].token_ids if "target_only" in results else None
            for name, result in results.items():
                if strict and reference is not None and result.token_ids != reference:
                    raise SpecterError(f"{name} tokens differ from target-only on prompt {i} (strict mode)")
                rows.append(records.record(name, i, result, None if name == "target_only" else reference))
    return rows


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except SpecterError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    try:
        check_group_choices(sys.argv[1:])
    except SpecterError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    main()
