"""Sphinx extension: the benchmark page's figures and tables, drawn from ``benchmarks/results``.

At the start of a build it reads the committed result files and writes, under
``docs/_generated/`` (not committed), PNG plots (loss against steps and against seconds, per-step
ratios to Adam) and Markdown tables that ``benchmarks.md`` includes. Nothing is measured here:
the page shows exactly what the JSON files hold, with the date and machine they record.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
OUT = Path(__file__).resolve().parents[1] / "_generated"


def _load(name: str) -> dict[str, Any] | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def _machine(d: dict[str, Any]) -> str:
    m = d.get("machine", {})
    bits = [str(m.get(k)) for k in ("date", "cpu_count", "jax") if m.get(k) is not None]
    return ", ".join(bits) if bits else "machine not recorded"


def _loss_plots(name: str, d: dict[str, Any], plt: Any) -> str:
    """Loss against steps and against estimated seconds for every optimizer of a training run."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for opt, r in d["results"].items():
        curve = r.get("loss_curve_every_10") or []
        if not curve:
            continue
        steps = [10 * i for i in range(len(curve))]
        a1.plot(steps, curve, label=opt)
        # Seconds: the first step (trace, compile, burn-in) then the mean step time of the run.
        secs = [r["first_step_s"] + max(s - 1, 0) * r["step_mean_s"] for s in steps]
        a2.plot(secs, curve, label=opt)
    for ax, xl in ((a1, "step"), (a2, "seconds (first step + mean step time)")):
        ax.set_xlabel(xl)
        ax.set_ylabel("training loss")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    a1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(OUT / f"{name}_loss.png", dpi=90)
    plt.close(fig)
    rows = ["| optimizer | first step (s) | median step (s) | steps run | final loss | steps to target | seconds to target |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for opt, r in d["results"].items():
        rows.append(
            f"| {opt} | {r['first_step_s']:.2f} | {r['step_median_s']:.3f} | {r.get('steps_run', '')} | "
            f"{r['final_loss']:.4g} | {r.get('steps_to_target') or 'not reached'} | "
            f"{'%.1f' % r['seconds_to_target'] if r.get('seconds_to_target') else '-'} |"
        )
    return "\n".join(rows)


def _ratio_table(d: dict[str, Any], plt: Any, name: str) -> str:
    summary = {k: v for k, v in d["summary"].items() if isinstance(v, dict)}
    fig, ax = plt.subplots(figsize=(7, 0.5 + 0.4 * len(summary)))
    names = list(summary)
    ax.barh(names, [summary[n]["ratio_median"] for n in names], label="median")
    ax.barh(names, [summary[n]["ratio_mean"] for n in names], alpha=0.35, label="mean (refreshes included)")
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel("step time / Adam step time (same run, interleaved)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(OUT / f"{name}.png", dpi=90)
    plt.close(fig)
    rows = ["| variant | median ratio | mean ratio | per-round median |", "| --- | --- | --- | --- |"]
    for n in names:
        s = summary[n]
        rows.append(f"| {n} | {s['ratio_median']:.2f}× | {s['ratio_mean']:.2f}× | {s['ratio_per_round_median']:.2f}× |")
    return "\n".join(rows)


def _fmt(x: Any, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def _compare_section(d: dict[str, Any], plt: Any) -> str:
    """``compare.json``: per model, loss against steps and seconds, and the table of every optimizer."""
    kfj = d.get("kfac_jax", {})
    note = (f"kfac-jax {kfj.get('kfac_jax')} ran in a child process under JAX {kfj.get('jax')}; its step ratio is "
            "taken against the Adam run of that process (`adam_kfac_jax_env`, same learning rate)."
            if kfj.get("status") == "ok" else f"kfac-jax: {kfj.get('status', 'not run')}.")
    parts = [f"## Against the alternatives\n\n`benchmarks/results/compare.json` ({_machine(d)}), written by "
             f"`benchmarks/compare.py`. Every optimizer starts from the same initialisation; learning rates "
             f"of the Optax optimizers come from a grid search (`tuning` in the file). {note} Seconds count "
             f"from before building the optimizer, so setup and compilation are included; *after compile* "
             f"leaves out setup and the first step. A run stops once its target is reached (after 10 timed "
             f"steps), at its step budget or at the time cap. *Ratio, interleaved*: after a model's runs, rounds of one "
             f"step of each optimizer in a rotating order, so the machine's drift hits all alike.\n"]
    for model, e in d["models"].items():
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
        for opt, r in e["results"].items():
            c = r["curve"]
            loss = [float("nan") if x is None else x for x in c["loss"]]  # null: not finite
            style = "--" if opt.startswith("adam_kfac_jax") else "-"
            a1.plot(c["step"], loss, style, label=opt)
            a2.plot(c["seconds"], loss, style, label=opt)
        for ax, xl in ((a1, "step"), (a2, "seconds (setup and compilation included)")):
            ax.axhline(e["target_loss"], color="k", lw=0.8, ls=":")
            ax.set_xlabel(xl)
            ax.set_ylabel("training loss")
            ax.set_yscale("log")
            ax.grid(alpha=0.3)
        a1.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(OUT / f"compare_{model}.png", dpi=90)
        plt.close(fig)
        rows = ["| optimizer | learning rate | setup (s) | first step (s) | median step (ms) | ratio to Adam, median (mean) "
                "| ratio, interleaved | steps to target | seconds to target | after compile (s) | steps run | final loss |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for opt, s in ((k, v) for k, v in e["summary"].items() if isinstance(v, dict)):
            lr = s["learning_rate"]
            ratio = "-" if s["step_ratio_median"] is None else f"{s['step_ratio_median']:.2f}× ({s['step_ratio_mean']:.2f}×)"
            rows.append(
                f"| {opt} | {lr if isinstance(lr, str) else _fmt(lr, 'g')} | {s['setup_s']:.1f} | {s['first_step_s']:.1f} | "
                f"{_fmt(s['step_median_s'] and 1000 * s['step_median_s'], '.1f')} | {ratio} | "
                f"{_fmt(s.get('interleaved_ratio_median'), '.2f')}{'×' if s.get('interleaved_ratio_median') else ''} | "
                f"{_fmt(s['steps_to_target'], 'd', 'not reached')} | {_fmt(s['seconds_to_target'], '.1f')} | "
                f"{_fmt(s['seconds_to_target_after_compile'], '.1f')} | {s['steps_run']} | {_fmt(s['final_loss'], '.4g')} |")
        parts.append(f"### {model}: target loss {e['target_loss']:g}\n\n{e['description']}; {e['num_params']} parameters; "
                     f"at most {e['max_steps']} steps.\n\n![{model}](/_generated/compare_{model}.png)\n\n" + "\n".join(rows) + "\n")
    return "\n".join(parts)


def generate(app: Any = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    OUT.mkdir(exist_ok=True)
    parts: list[str] = []
    for name, title in (("autoencoder", "MNIST autoencoder, training to a target loss"), ("cnn", "MNIST CNN")):
        d = _load(f"{name}.json")
        if d is None:
            continue
        table = _loss_plots(name, d, plt)
        parts.append(f"## {title}\n\n`benchmarks/results/{name}.json` ({_machine(d)}).\n\n"
                     f"![{title}](/_generated/{name}_loss.png)\n\n{table}\n")
    for name, title in (("step_ratio", "Per-step ratios to Adam"), ("step_ratio_user_grad", "The user's gradient: shared pass vs fallback")):
        d = _load(f"{name}.json")
        if d is None:
            continue
        table = _ratio_table(d, plt, name)
        parts.append(f"## {title}\n\n`benchmarks/results/{name}.json` ({_machine(d)}; Adam step "
                     f"{1000 * d['summary']['adam_step_median_s']:.0f} ms).\n\n![{title}](/_generated/{name}.png)\n\n{table}\n")
    d = _load("first_step.json")
    if d is not None:
        rows = ["| optimizer | first step, no cache (s) | first step, warm cache (s) | process, no cache (s) | process, warm cache (s) |",
                "| --- | --- | --- | --- | --- |"]
        for opt, r in d["summary_median"].items():
            nc, w = r.get("no_cache", {}), r.get("warm", {})
            cells = [nc.get("first_step_s"), w.get("first_step_s"), nc.get("process_s"), w.get("process_s")]
            rows.append(f"| {opt} | " + " | ".join("-" if c is None else f"{c:.2f}" for c in cells) + " |")
        parts.append(f"## First step, fresh processes\n\n`benchmarks/results/first_step.json` ({_machine(d)}).\n\n" + "\n".join(rows) + "\n")
    d = _load("compare.json")
    if d is not None:
        parts.append(_compare_section(d, plt))
    (OUT / "benchmark_results.md").write_text("\n".join(parts) if parts else "No result files found.\n")


def setup(app: Any) -> dict[str, Any]:
    app.connect("builder-inited", generate)
    return {"version": "1", "parallel_read_safe": True}
