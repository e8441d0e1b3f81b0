"""Draws `kvq eval --plot`'s picture from the JSON it writes: each scheme's attention error against its effective
bits with the Pareto front (the schemes no other beats on both), and the attention error of each layer.

    python3 plot.py RESULTS.json OUT.png       (kvq eval --plot OUT.png runs this; it needs matplotlib only)"""
import json
import sys


def pareto(points):
    """Indices of the points (bits, err) that no other point beats on both, by increasing bits."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front, best = [], float("inf")
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return front


def draw(data, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    # An error kvq eval could not measure (NaN input, zero reference) is null: such a scheme is left out of the
    # first panel and such a layer out of the second, never drawn as a made-up value.
    unmeasured = [s["name"] for s in data["schemes"] if s["attn_rel_err"] is None]
    schemes = [s for s in data["schemes"] if s["attn_rel_err"] is not None]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    pts = [(s["effective_bits"], max(s["attn_rel_err"], 1e-9)) for s in schemes]
    for s, (b, e) in zip(schemes, pts):
        ax.scatter([b], [e], s=36, zorder=3)
        ax.annotate(s["name"], (b, e), textcoords="offset points", xytext=(5, 4), fontsize=8)
    front = pareto(pts)
    if len(front) > 1:
        ax.plot([pts[i][0] for i in front], [pts[i][1] for i in front], "k--", lw=1, zorder=2, label="Pareto front")
        ax.legend(fontsize=8)
    ax.set_xlabel("effective bits per stored element (metadata included)")
    ax.set_ylabel("attention output relative error")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    src = "synthetic" if data.get("synthetic") else ".npy inputs"
    ax.set_title("error vs bits: %d tokens (prefill %d), %s" % (data["tokens"], data["prefill"], src), fontsize=10)
    for s in schemes:
        layers = [(l, max(e, 1e-9)) for l, e in enumerate(s["attn_layer_rel_err"]) if e is not None]
        ax2.plot([l for l, _ in layers], [e for _, e in layers], marker="o", ms=3, label=s["name"])
    from matplotlib.ticker import MaxNLocator
    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.set_xlabel("layer")
    ax2.set_ylabel("attention output relative error")
    ax2.set_yscale("log")
    ax2.grid(True, which="both", alpha=0.3)
    ax2.set_title("per layer (%d layers, %d heads, %d kv heads, head_dim %d)" % (
        data["layers"], data["heads"], data["kv_heads"], data["head_dim"]), fontsize=10)
    ax2.legend(fontsize=8)
    notes = []
    if any(s["attn_rel_err"] <= 0 or min([e for e in s["attn_layer_rel_err"] if e is not None] or [1]) <= 0
           for s in schemes):
        notes.append("an error of 0 (lossless) is drawn at 1e-9")
    if unmeasured:
        notes.append("not measured (nan or undefined), not drawn: " + ", ".join(unmeasured))
    if notes:
        fig.text(0.01, 0.01, "; ".join(notes), fontsize=7, color="gray")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: plot.py RESULTS.json OUT.png", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        data = json.load(f)
    if not data["schemes"]:
        print("plot.py: no scheme ran", file=sys.stderr)
        return 1
    draw(data, argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
