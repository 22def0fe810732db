"""Tables for the terminal (Markdown, to paste into a PR), `bench.json`, and the PNG plots.

Plots go through matplotlib's Agg canvas directly, without pyplot, so nothing global (the backend,
open figures) changes in the caller's process.
"""

from __future__ import annotations

import json
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

PLAIN, DFLASH = "plain", "dflash"


def fmt(v: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if v is None else f"{v:{spec}}{suffix}"


def pct3(d: dict) -> str:
    return "/".join(fmt(d.get(k)) for k in ("p50", "p95", "p99"))


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = lambda cells: "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"
    return "\n".join([line(header), "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"]
                     + [line(r) for r in rows])


def tau(arm: dict | None) -> float | None:
    return ((arm or {}).get("spec") or {}).get("acceptance_length")


def latency_cells(arm: dict) -> list[str]:
    return [pct3(arm["ttft_ms"]), pct3(arm["tpot_ms"]), pct3(arm["itl_ms"])]


LATENCY_HEADER = ["TTFT ms p50/p95/p99", "TPOT ms p50/p95/p99", "ITL ms p50/p95/p99"]


def format_report(result: dict) -> str:
    cfg, rows = result["config"], result["results"]
    arms = cfg["arms"]
    lat_arm = DFLASH if DFLASH in arms else PLAIN
    out = [f"flashdraft bench: {cfg['model']} | draft {cfg.get('draft') or '-'} | {cfg['dataset']} "
           f"({cfg['num_prompts']} prompts, {'chat' if cfg['chat'] else 'raw'}) | max_tokens {cfg['max_tokens']} | "
           f"T={cfg['temperature']} | {cfg.get('device', '-')} {cfg.get('dtype', '') or ''}".rstrip(), ""]
    body = []
    for r in rows:
        a = r["arms"]
        same = r.get("same_output")
        body.append([str(r["concurrency"]), fmt(a.get(PLAIN, {}).get("output_tok_s")),
                     fmt(a.get(DFLASH, {}).get("output_tok_s")), fmt(r.get("speedup"), ".2f", "x"),
                     fmt(tau(a.get(DFLASH)), ".2f"), *latency_cells(a[lat_arm]),
                     f"{same['matched']}/{same['total']}" if same else "-"])
    out.append(table(["conc", "plain tok/s", "DFlash tok/s", "speedup", "tau", *LATENCY_HEADER, "same output"], body))
    if PLAIN in arms and DFLASH in arms:
        out += ["", "plain arm latencies:",
                table(["conc", *LATENCY_HEADER], [[str(r["concurrency"]), *latency_cells(r["arms"][PLAIN])]
                                                  for r in rows])]
    specs = [(r["concurrency"], r["arms"].get(DFLASH, {}).get("spec")) for r in rows]
    specs = [(c, s) for c, s in specs if s and s.get("num_drafts")]
    if specs:
        npos = max(len(s["acceptance_rate_per_position"]) for _, s in specs)
        out += ["", "DFlash per-position acceptance rate (fraction of verify steps that accepted draft i; gated: "
                    "request steps decoded without drafts by the acceptance gate, not in tau):",
                table(["conc", "tau", "drafts", "gated", *(f"pos {i + 1}" for i in range(npos))],
                      [[str(c), fmt(s["acceptance_length"], ".2f"), str(s["num_drafts"]),
                        str(s.get("gated_steps") or 0), *(fmt(x, ".3f") for x in s["acceptance_rate_per_position"])]
                       for c, s in specs])]
        hists = [(c, s) for c, s in specs if s.get("acceptance_histogram")]
        if hists:
            nh = max(len(s["acceptance_histogram"]) for _, s in hists)
            out += ["", "accepted drafts per verify step (fraction of steps):",
                    table(["conc", *(f"a={i}" for i in range(nh))],
                          [[str(c), *(fmt(x / s["num_drafts"], ".3f") for x in s["acceptance_histogram"])]
                           for c, s in hists])]
    masks = [(r["concurrency"], [r["arms"].get(a, {}).get("grammar_mask_ms_per_step") for a in (PLAIN, DFLASH)])
             for r in rows]
    if any(m is not None for _, ms in masks for m in ms):
        out += ["", f"grammar masks ({cfg.get('constrained', 0)} constrained prompts), host ms per engine step:",
                table(["conc", "plain", "DFlash"], [[str(c), fmt(p, ".3f"), fmt(d, ".3f")] for c, (p, d) in masks])]
    itl = rows[0]["arms"][lat_arm]["itl_convention"] if rows else "per-token"
    out += ["", f"speedup = DFlash tok/s / plain tok/s at the same concurrency; tau = tokens committed per verify "
                f"step over the arm; ITL is {itl} ("
                + ("a speculative step's gap divided evenly among the tokens it commits" if itl == "per-token"
                   else "the interval between streamed chunks") + ")."]
    if rows and rows[0].get("same_output"):
        out.append("same output = prompts whose DFlash output equals the plain output"
                   + (" (the losslessness check at T=0)." if cfg["temperature"] == 0 else " (same seed per prompt)."))
    return "\n".join(out)


def write_json(result: dict, path: Path) -> Path:
    path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return path


def _axes(title: str, ylabel: str, concurrencies: list[int]):
    fig = Figure(figsize=(6.4, 4.2), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel(ylabel)
    ax.set_xscale("log", base=2)
    ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
    ax.minorticks_off()
    ax.grid(True, alpha=0.3)
    return fig, ax


def _label(ax, xs, ys, spec: str) -> None:
    for x, y in zip(xs, ys):
        ax.annotate(f"{y:{spec}}", (x, y), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8)


def _subtitle(cfg: dict) -> str:
    return f"{cfg['model']}, {cfg['dataset']}, T={cfg['temperature']}, max_tokens {cfg['max_tokens']}"


def write_plots(result: dict, out_dir: Path) -> list[Path]:
    cfg = result["config"]
    rows = sorted(result["results"], key=lambda r: r["concurrency"])
    cs = [r["concurrency"] for r in rows]
    written = []

    def save(fig: Figure, name: str) -> None:
        path = out_dir / name
        fig.savefig(path)
        written.append(path)

    fig, ax = _axes(f"Output throughput\n{_subtitle(cfg)}", "output tokens / s", cs)
    for arm, label, color in ((PLAIN, "plain", "tab:gray"), (DFLASH, "DFlash", "tab:blue")):
        pts = [(c, r["arms"][arm]["output_tok_s"]) for c, r in zip(cs, rows) if arm in r["arms"]]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=label, color=color)
            _label(ax, *zip(*pts), ".0f" if max(y for _, y in pts) >= 100 else ".1f")
    if ax.lines:
        ax.set_ylim(0, max(max(line.get_ydata()) for line in ax.lines) * 1.15)
    ax.legend()
    save(fig, "throughput.png")

    sp = [(c, r["speedup"]) for c, r in zip(cs, rows) if r.get("speedup") is not None]
    if sp:
        fig, ax = _axes(f"DFlash speedup over plain decoding\n{_subtitle(cfg)}", "speedup (x)", cs)
        ax.axhline(1.0, color="tab:gray", linestyle="--", linewidth=1)
        ax.plot(*zip(*sp), marker="o", color="tab:blue")
        _label(ax, *zip(*sp), ".2f")
        ax.set_ylim(0, max(1.2, max(y for _, y in sp) * 1.15))
        save(fig, "speedup.png")

    ta = [(c, tau(r["arms"].get(DFLASH))) for c, r in zip(cs, rows)]
    ta = [(c, t) for c, t in ta if t is not None]
    if ta:
        fig, ax = _axes(f"DFlash acceptance length (tau)\n{_subtitle(cfg)}", "tau (tokens per verify step)", cs)
        ax.plot(*zip(*ta), marker="o", color="tab:green")
        _label(ax, *zip(*ta), ".2f")
        ax.set_ylim(0, max(2.0, max(t for _, t in ta) * 1.15))
        save(fig, "tau.png")

        fig = Figure(figsize=(6.4, 4.2), dpi=110, layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        for c, r in zip(cs, rows):
            rates = (r["arms"].get(DFLASH, {}).get("spec") or {}).get("acceptance_rate_per_position") or []
            if rates:
                ax.plot(range(1, len(rates) + 1), rates, marker="o", label=f"c={c}")
        ax.set_title(f"DFlash per-position acceptance rate\n{_subtitle(cfg)}", fontsize=10)
        ax.set_xlabel("draft position")
        ax.set_ylabel("fraction of verify steps accepting it")
        ax.set_ylim(0, 1.02)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        save(fig, "acceptance.png")
    return written
