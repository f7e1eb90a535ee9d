"""The figure of ``elastic-ft plot``: a run at a glance, drawn with matplotlib (the ``plot`` extra).

Two panels. Above, against the step: the loss (the try the run kept, and the
tries lost to a restart as crosses), the held-out eval loss (diamonds), the learning rate on its own axis, and a
triangle on the loss curve at each committed checkpoint. Below, against wall
time: tokens/s and the world size on its own axis, one segment per attempt.
Preemptions, lost nodes, rescales and restarts are vertical lines across
both. Drawn on a bare :class:`~matplotlib.figure.Figure` with the Agg canvas:
no display, no pyplot state, so it works on a headless node.
"""

from __future__ import annotations

from elastic_ft.viz.series import RunSeries

PLOT_EXTRA = "pip install 'elastic-ft[plot]'"

# Vertical lines: (colour, line style, legend label) per kind of mark.
_LINES = {
    "preempted": ("tab:red", "--", "preemption (spot notice)"),
    "node_lost": ("tab:red", ":", "node lost"),
    "rescale": ("tab:purple", "-.", "rescale"),
    "restart": ("tab:gray", ":", "restart (new attempt)"),
}
_CHECKPOINT = {"color": "tab:green", "linestyle": "none", "markersize": 7, "label": "checkpoint"}


class MissingExtra(RuntimeError):
    """An optional package a command needs is not installed; the message says which extra to install."""


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise MissingExtra(f"plot needs matplotlib, which is not installed: {PLOT_EXTRA}") from None
    return Figure, FigureCanvasAgg, MaxNLocator


def draw(series: RunSeries, *, width: int = 1200, height: int = 800, dpi: int = 100):
    """The figure (``width`` x ``height`` pixels once saved at ``dpi``); raises :class:`MissingExtra`."""
    Figure, FigureCanvasAgg, MaxNLocator = _matplotlib()
    fig = Figure(figsize=(width / dpi, height / dpi), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    by_step, by_time = fig.subplots(2, 1)
    last = series.step[-1] if series.step else 0
    of = f"/{series.total_steps}" if series.total_steps else ""
    fig.suptitle(f"run {series.run_id or '?'}: step {last}{of}, {series.attempts} attempt(s)", fontweight="bold")
    _draw_steps(by_step, series, MaxNLocator)
    _draw_time(by_time, series, MaxNLocator)
    if not series.step:
        by_step.text(0.5, 0.5, "no step has finished yet", transform=by_step.transAxes, ha="center", va="center")
    return fig


def _draw_steps(ax, s: RunSeries, MaxNLocator) -> None:
    ax.set_title("loss and learning rate by step")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.plot(s.step, s.loss, color="tab:blue", marker="." if len(s.step) < 200 else None, label="loss")
    if s.redone_step:
        ax.plot(s.redone_step, s.redone_loss, color="tab:blue", alpha=0.5, linestyle="none", marker="x",
                label="loss (a try lost to a restart)")
    if s.eval_step:
        ax.plot(s.eval_step, s.eval_loss, color="tab:red", marker="D", markersize=5, label="eval loss (held out)")
    checkpoints = [(m.step, s.loss_at(m.step)) for m in s.marks if m.kind == "checkpoint"]
    checkpoints = [(x, y) for x, y in checkpoints if y is not None]
    if checkpoints:
        ax.plot([x for x, _ in checkpoints], [y for _, y in checkpoints], marker="v", **_CHECKPOINT)
    _vertical_lines(ax, [(m.kind, m.step) for m in s.marks])
    lr = ax.twinx()
    lr.set_ylabel("learning rate")
    lr.plot(s.step, s.lr, color="tab:orange", label="lr")
    lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    _legend(ax, lr)


def _draw_time(ax, s: RunSeries, MaxNLocator) -> None:
    ax.set_title("throughput and world size over wall time")
    ax.set_xlabel("wall time since the run began (s)")
    ax.set_ylabel("tokens/s")
    world = ax.twinx()
    world.set_ylabel("world size (ranks)")
    world.yaxis.set_major_locator(MaxNLocator(integer=True))
    for i, seg in enumerate(s.segments):  # one line per attempt: a restart's gap stays a gap
        ax.plot(seg.t, seg.tokens_per_s, color="tab:cyan", label="tokens/s" if i == 0 else None)
        world.plot(seg.t, seg.world, color="tab:brown", drawstyle="steps-post", linewidth=2,
                   label="world" if i == 0 else None)
    top = max((w for seg in s.segments for w in seg.world), default=1)
    world.set_ylim(0, top + 1)
    ax.set_ylim(bottom=0)
    saved = [m.t for m in s.marks if m.kind == "checkpoint"]
    if saved:  # along the bottom edge: a checkpoint has a time but no throughput
        ax.plot(saved, [0.02] * len(saved), marker="^", transform=ax.get_xaxis_transform(), **_CHECKPOINT)
    _vertical_lines(ax, [(m.kind, m.t) for m in s.marks])
    _legend(ax, world)


def _vertical_lines(ax, marks: list[tuple[str, float]]) -> None:
    labelled = set()
    for kind, x in marks:
        if kind not in _LINES:
            continue
        color, style, label = _LINES[kind]
        ax.axvline(x, color=color, linestyle=style, linewidth=1.5, label=None if kind in labelled else label)
        labelled.add(kind)


def _legend(ax, twin) -> None:
    """One legend for an axis and its twin, right of both: inside, it would hide the curves it names."""
    handles, labels = ax.get_legend_handles_labels()
    more, more_labels = twin.get_legend_handles_labels()
    ax.legend(handles + more, labels + more_labels, loc="upper left", bbox_to_anchor=(1.08, 1.0),
              fontsize="small", borderaxespad=0.0)


def render(series: RunSeries, out: str, *, width: int = 1200, height: int = 800, dpi: int = 100) -> None:
    """Draw and write ``out`` as a PNG of ``width`` x ``height`` pixels; raises :class:`MissingExtra`."""
    fig = draw(series, width=width, height=height, dpi=dpi)
    fig.savefig(out, format="png", dpi=dpi)
