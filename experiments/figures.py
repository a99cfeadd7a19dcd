"""Render the paper's figures from result files only (never a live run): PNG + PDF + the CSV drawn.

    python -m experiments.figures results/paper

Per model and memory setting the newest complete run is drawn (`result_runs.chosen_runs`); a figure that
cannot be drawn is listed with the reason.
"""
from __future__ import annotations

import json

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter  # noqa: E402

from experiments.result_runs import measured, summaries  # noqa: E402
from specter.errors import SpecterError  # noqa: E402

Drawn = list  # the paths a figure wrote; a figure that cannot be drawn returns the reason (a str) instead


def _save(fig, data: pd.DataFrame, out: Path, stem: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.png", out / f"{stem}.pdf", out / f"{stem}.csv"]
    fig.savefig(paths[0], dpi=120, bbox_inches="tight")
    fig.savefig(paths[1], bbox_inches="tight")
    data.to_csv(paths[2], index=False)
    plt.close(fig)
    return paths


SYSTEM_LABELS = {"specter": "Specter (default)", "specter_paper": "Specter (paper's design)"}  # the two Specters


def figure7_depth(root: Path, out: Path) -> Drawn | str:
    """TPOT vs speculation depth K, one line per model/memory run."""
    data = measured(root, "depth")
    if data.empty:
        return "no depth runs (experiment=depth)"
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for run, rows in data.groupby("run"):
        rows = rows.sort_values("k")
        ax.plot(rows.k, rows.tpot_ms, marker="o", label=run)
    ax.set(xlabel="speculation depth K", ylabel="TPOT (ms)", title="Figure 7: TPOT vs K")
    ax.legend(fontsize=7)
    return _save(fig, data, out, "fig7_depth")


def kernel_runs(root: Path) -> pd.DataFrame | str:
    data = summaries(root, "kernel", "kernel.csv")
    if data.empty:
        return "no kernel runs: experiment=kernel times Triton kernels on a CUDA GPU (none was used)"
    return data


def figure10_kernel_speedup(root: Path, out: Path) -> Drawn | str:
    """The fused INT4 kernel's speedup over FP16 expert-wise execution vs tokens, one line per model."""
    data = kernel_runs(root)
    if isinstance(data, str):
        return data
    times = data.pivot_table(index=["model", "tokens"], columns="system", values="median_ms").reset_index()
    if not {"fused_int4", "fp16_expert_wise"} <= set(times.columns):
        return "the kernel runs lack fused_int4 or fp16_expert_wise rows"
    times["speedup"] = times.fp16_expert_wise / times.fused_int4
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for model, rows in times.groupby("model", sort=False):
        ax.plot(rows.tokens, rows.speedup, marker="o", label=model)
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set(xscale="log", xlabel="tokens", ylabel="FP16 time / fused INT4 time",
           title="Figure 10: fused INT4 draft kernel vs FP16")
    ax.legend(fontsize=7)
    return _save(fig, times, out, "fig10_kernel_speedup")


def figure11_kernel(root: Path, out: Path) -> Drawn | str:
    """Median time per system and token count at each model's expert shape."""
    data = kernel_runs(root)
    if isinstance(data, str):
        return data
    models = list(dict.fromkeys(data.model))
    fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 3.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        for system, rows in data[data.model == model].groupby("system"):
            ax.plot(rows.tokens, rows.median_ms, marker="o", label=system)
        ax.set(xscale="log", yscale="log", xlabel="tokens", ylabel="median ms", title=model)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Figure 11: fused INT4 draft kernel")
    return _save(fig, data, out, "fig11_kernel")


def figure13_routing(root: Path, out: Path) -> Drawn | str:
    """Per run (model and memory setting): per-window working-set sizes per dataset (left) and pairwise
    Jensen-Shannon distances between the datasets' routing (right; needs two datasets or more)."""
    sets, js = summaries(root, "routing", "routing_working_sets.csv"), summaries(root, "routing", "routing_js.csv")
    if sets.empty:
        return "no routing runs (experiment=routing)"
    runs = list(dict.fromkeys(sets.run))
    fig, axes = plt.subplots(len(runs), 2, figsize=(9, 3.5 * len(runs)), squeeze=False)
    for (left, right), run in zip(axes, runs):
        run_sets = sets[sets.run == run]
        names = list(dict.fromkeys(run_sets.dataset))
        left.boxplot([run_sets[run_sets.dataset == n].working_set for n in names])
        left.set_xticks(range(1, len(names) + 1), names, rotation=45)
        left.set(ylabel="distinct experts per layer per window", title=f"{run}: working sets")
        if len(names) < 2:
            right.axis("off")
            right.text(0.5, 0.5, "Jensen-Shannon distance:\nneeds two datasets or more", ha="center", va="center")
            continue
        matrix = pd.DataFrame(0.0, index=names, columns=names)
        for _, row in js[js.run == run].iterrows():
            matrix.loc[row.dataset_a, row.dataset_b] = matrix.loc[row.dataset_b, row.dataset_a] = row.js_distance
        image = right.imshow(matrix.values, cmap="viridis")
        right.set_xticks(range(len(names)), names, rotation=45)
        right.set_yticks(range(len(names)), names)
        right.set_title(f"{run}: Jensen-Shannon distance")
        fig.colorbar(image, ax=right)
    fig.suptitle("Figure 13: routing diversity")
    fig.tight_layout()
    return _save(fig, pd.concat([sets.assign(kind="working_set"), js.assign(kind="js")]), out, "fig13_routing")


def locality_figure(data: pd.DataFrame, out: Path, stem: str) -> list[Path]:
    """Hit rate vs cache size (rho x top_k) per eviction policy: measured (solid) against the real model (dashed)."""
    curves = data[data.metric != "draft_topk_recall"]
    policies = list(dict.fromkeys(curves.metric))
    fig, axes = plt.subplots(1, len(policies), figsize=(3.2 * len(policies), 3.2), squeeze=False, sharey=True)
    for ax, policy in zip(axes[0], policies):
        for model, rows in curves[curves.metric == policy].groupby("model"):
            line, = ax.plot(rows.rho, rows.measured, marker="o", label=f"{model} measured")
            real = rows.dropna(subset=["real"])
            if not real.empty:
                ax.plot(real.rho, real.real, ls="--", color=line.get_color(), label=f"{model} real")
        ax.set(xlabel="cache size / top-k (rho)", title=policy, ylim=(0, 1.05))
    axes[0][0].set_ylabel("hit rate")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Routing locality: measured vs real checkpoint", y=1.04)
    return _save(fig, data, out, stem)


def figure_routing_locality(root: Path, out: Path) -> Drawn | str:
    """Every routing run's locality curves against the real checkpoints'."""
    data = summaries(root, "routing", "routing_locality.csv")
    if data.empty:
        return "no routing runs (experiment=routing)"
    return locality_figure(data.assign(model=data.run), out, "routing_locality")


def figure14_main(root: Path, out: Path) -> Drawn | str:
    """TPOT per dataset and system on a log axis, one panel per model/memory run, each bar labelled with its TPOT
    over Specter's in the same run (a same-run ratio); "AVG" only where several datasets were averaged; one
    legend below the panels."""
    data = measured(root, "main")
    if data.empty:
        return "no main runs (experiment=main)"
    runs = list(dict.fromkeys(data.run))
    cols = min(2, len(runs))
    rows = -(-len(runs) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 3.8 * rows), squeeze=False)
    for ax in axes.flat[len(runs):]:
        ax.set_visible(False)
    for ax, run in zip(axes.flat, runs):
        table = main_panel(data[data.run == run])
        table.rename(columns=system_labels(root / "main" / run)).plot.bar(ax=ax, rot=0, legend=False, logy=True)
        if "specter" in table:
            ratios = main_panel(data[data.run == run], "tpot_over_specter") if "tpot_over_specter" in data \
                else table.div(table["specter"], axis=0)  # [datasets, systems]: TPOT / Specter's, same run
            ratios = ratios.reindex(index=table.index, columns=table.columns)
            for container, system in zip(ax.containers, table.columns):
                ax.bar_label(container, labels=[f"{r:.2f}x" for r in ratios[system]], fontsize=5, rotation=90)
        ax.set(ylabel="TPOT (ms, log scale)", title=run)
    handles = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=min(len(handles), 5), fontsize=7,
               bbox_to_anchor=(0.5, -0.02))
    fig.suptitle("Figure 14: TPOT per dataset and system (bar labels: TPOT / Specter's, same run)")
    fig.tight_layout(rect=(0, 0.1, 1, 0.95))  # room for the legend below and the title above
    return _save(fig, data, out, "fig14_main")


def system_labels(run_dir: Path) -> dict[str, str]:
    """Legend names of the two Specters. A run from before the default changed (its run.json's Specter options
    lack `pooled_slots`) ran the paper's design as `specter`."""
    try:
        options = json.loads((run_dir / "run.json").read_text())["config"]["specter"]
    except (OSError, ValueError, KeyError, TypeError):
        return SYSTEM_LABELS
    return SYSTEM_LABELS if "pooled_slots" in options else {"specter": "Specter (paper's design)"}


def main_panel(rows: pd.DataFrame, values: str = "tpot_ms") -> pd.DataFrame:
    """One run's median TPOT (or another summary column) [datasets, systems], without the AVG row when it
    averages a single dataset."""
    table = rows.pivot_table(index="dataset", columns="system", values=values, sort=False)
    if (table.index != "AVG").sum() < 2:
        table = table.drop(index="AVG", errors="ignore")
    return table


def _batch_averages(root: Path) -> pd.DataFrame:
    data = measured(root, "batch")
    return data[data.dataset == "AVG"] if not data.empty else data


def _batch_axis(ax, sizes: pd.Series) -> None:
    """Batch sizes on a log2 axis, ticked at the measured sizes."""
    ticks = sorted({int(b) for b in sizes})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(b) for b in ticks])
    ax.set_xlabel("batch size")


def _log_values(ax) -> None:
    """A log y axis ticked 1, 2, 5, 10, 20, ... in plain numbers."""
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())


def figure15_batch(root: Path, out: Path) -> Drawn | str:
    """Median TPOT (left) and throughput (right) vs batch size on log axes, one line per system and run."""
    data = _batch_averages(root)
    if data.empty:
        return "no batch runs (experiment=batch)"
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    for (run, system), rows in data.groupby(["run", "system"], sort=False):
        rows = rows.sort_values("batch_size")
        label = f"{SYSTEM_LABELS.get(system, system)} ({run})"
        left.plot(rows.batch_size, rows.tpot_ms, marker="o", label=label)
        right.plot(rows.batch_size, rows.throughput_tok_s, marker="o", label=label)
    for ax in (left, right):
        _batch_axis(ax, data.batch_size)
        _log_values(ax)  # TPOT spans milliseconds to seconds across systems and batch sizes
    left.set(ylabel="TPOT (ms, median, log scale)")
    right.set(ylabel="throughput (tokens/s, log scale)")
    left.legend(fontsize=6)
    fig.suptitle("Figure 15: batched decoding")
    fig.tight_layout()
    return _save(fig, data, out, "fig15_batch")


def figure16_working_set(root: Path, out: Path) -> Drawn | str:
    """Distinct experts per layer per verify window vs batch size (Specter's runs), at the batch sizes
    whose requests were distinct prompts (a batch larger than num_prompts repeats prompts)."""
    data = _batch_averages(root)
    if data.empty or "working_set_mean" not in data or data.working_set_mean.isna().all():
        return "no batch runs with Specter's working set (experiment=batch)"
    data = data[data.working_set_mean.notna()]
    distinct = data[data.batch_size <= data.num_prompts.fillna(float("inf"))]
    if distinct.batch_size.nunique() < 2:
        return (f"fewer than two batch sizes with distinct prompts (num_prompts {sorted(set(data.num_prompts))}): "
                f"run experiment=batch with num_prompts at least the largest batch size")
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for (run, system), rows in distinct.groupby(["run", "system"], sort=False):
        rows = rows.sort_values("batch_size")
        ax.plot(rows.batch_size, rows.working_set_mean, marker="o", label=f"{system} ({run})")
    _batch_axis(ax, distinct.batch_size)
    left_out = sorted(set(data.batch_size) - set(distinct.batch_size))
    note = f" (B={', '.join(map(str, left_out))} left out: repeated prompts)" if left_out else ""
    ax.set(ylabel="distinct experts / layer / window", title=f"Figure 16: expert working set vs batch size{note}")
    ax.title.set_fontsize(8 if note else 10)
    ax.legend(fontsize=7)
    return _save(fig, distinct, out, "fig16_working_set")


def table3_batch(root: Path, out: Path) -> Drawn | str:
    """Per-dataset results at each run's largest batch size: CSV and a Markdown table."""
    data = measured(root, "batch")
    if data.empty:
        return "no batch runs (experiment=batch)"
    largest = data.groupby("run").batch_size.transform("max")
    cols = [c for c in ("run", "system", "dataset", "batch_size", "tpot_ms", "throughput_tok_s", "tpot_over_specter")
            if c in data]
    table = data[data.batch_size == largest][cols].astype({"batch_size": int})
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "table3_batch.csv", out / "table3_batch.md"]
    table.to_csv(paths[0], index=False)
    paths[1].write_text(markdown_table(table))
    return paths


def markdown_table(frame: pd.DataFrame) -> str:
    """A Markdown table (floats to two decimals, missing values as '-')."""
    def cell(value) -> str:
        if pd.isna(value):
            return "-"
        return f"{value:.2f}" if isinstance(value, float) else str(value)
    lines = ["| " + " | ".join(frame.columns) + " |", "|" + " --- |" * len(frame.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines) + "\n"


FIGURES = (figure7_depth, figure10_kernel_speedup, figure11_kernel, figure13_routing, figure_routing_locality,
           figure14_main, figure15_batch, figure16_working_set, table3_batch)


def render_all(root: Path) -> list[Path]:
    """Every figure that the results under `root` can draw; the others are listed on stderr with the reason."""
    if not root.is_dir():
        raise SpecterError(f"results directory {root} does not exist")
    written = []
    for figure in FIGURES:
        drawn = figure(root, root / "figures")
        if isinstance(drawn, str):
            print(f"figures: skipped {figure.__name__}: {drawn}", file=sys.stderr)
        else:
            written += drawn
    if not written:
        raise SpecterError(f"nothing to draw under {root}: no results directory with records.csv or a result "
                           f"table (run an experiment first; the reasons per figure are listed above)")
    return written


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    root = Path(args[0]) if args else Path("results")
    try:
        for path in render_all(root):
            print(path)
    except SpecterError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
