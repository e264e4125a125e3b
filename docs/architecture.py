"""Draw docs/architecture.png, the system picture linked from README.md and docs/architecture.md.

    .venv/bin/python docs/architecture.py            # writes docs/architecture.png
    .venv/bin/python docs/architecture.py OUT.png    # writes elsewhere

Boxes are placed on a 100 x 62.5 grid; arrows run between box edges, so moving a box moves its arrows.
Keep the names here the names in the code (deployments/*.py) and in docs/architecture.md.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

W, H = 100, 62.5
BLUE, GREEN, ORANGE, PURPLE, GREY = "#dbe9f6", "#dcefd9", "#fde7cf", "#e8def3", "#eeeeee"
EDGE = "#333333"


@dataclass
class Box:
    x0: float
    y0: float
    x1: float
    y1: float

    @property
    def cx(self) -> float:
        return (self.x0 + self.x1) / 2

    @property
    def cy(self) -> float:
        return (self.y0 + self.y1) / 2

    def left(self, y: float | None = None):
        return (self.x0, self.cy if y is None else y)

    def right(self, y: float | None = None):
        return (self.x1, self.cy if y is None else y)

    def top(self, x: float | None = None):
        return (self.cx if x is None else x, self.y1)

    def bottom(self, x: float | None = None):
        return (self.cx if x is None else x, self.y0)


def box(ax, x0, y0, x1, y1, title, body="", color=BLUE, dashed=False, title_size=13, body_size=10.5,
        title_at_top=True, z=2) -> Box:
    ax.add_patch(FancyBboxPatch((x0, y0), x1 - x0, y1 - y0, boxstyle="round,pad=0,rounding_size=0.8",
                                facecolor=color, edgecolor=EDGE, linewidth=1.6 if not dashed else 1.3,
                                linestyle="--" if dashed else "-", zorder=z))
    if title_at_top:
        ax.text(x0 + 0.8, y1 - 0.7, title, ha="left", va="top", fontsize=title_size, fontweight="bold", zorder=z + 1)
        if body:
            ax.text(x0 + 0.8, y1 - 3.4, body, ha="left", va="top", fontsize=body_size, zorder=z + 1, linespacing=1.35)
    else:
        ax.text((x0 + x1) / 2, (y0 + y1) / 2 + (1.4 if body else 0), title, ha="center", va="center",
                fontsize=title_size, fontweight="bold", zorder=z + 1)
        if body:
            ax.text((x0 + x1) / 2, (y0 + y1) / 2 - 1.3, body, ha="center", va="center", fontsize=body_size,
                    zorder=z + 1, linespacing=1.3)
    return Box(x0, y0, x1, y1)


def arrow(ax, start, end, label="", label_at=None, both=False, dashed=False, color=EDGE, size=10,
          ha="center", va="bottom", rad=0.0):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="<|-|>" if both else "-|>", mutation_scale=16,
                                 linewidth=1.6, color=color, linestyle="--" if dashed else "-",
                                 connectionstyle=f"arc3,rad={rad}", shrinkA=0, shrinkB=0, zorder=5))
    if label:
        x, y = label_at or ((start[0] + end[0]) / 2, (start[1] + end[1]) / 2 + 0.5)
        ax.text(x, y, label, ha=ha, va=va, fontsize=size, color=color, zorder=6, linespacing=1.25,
                bbox=dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none", alpha=0.85))


def draw(out: Path) -> None:
    fig, ax = plt.subplots(figsize=(17, 10.6))
    ax.set_xlim(0, W)
    ax.set_ylim(0, H)
    ax.axis("off")
    ax.text(W / 2, H - 0.6, "specserve: continuous batching + speculative decoding on Ray Serve",
            ha="center", va="top", fontsize=17, fontweight="bold")

    # ---- the Ray cluster (KubeRay RayService on Kubernetes; a local Ray cluster for `make serve`) --------
    box(ax, 20, 13.5, 99, 59, "KubeRay RayService: a Ray cluster + Serve application on Kubernetes"
        "   (`make serve`: the same on a local Ray cluster)", color="#fafafa", dashed=True, title_size=12.5, z=0)

    ingress = box(ax, 23, 24, 39, 43, "OpenAIIngress",
                  "FastAPI deployment\n\n• /v1/chat/completions,\n  /v1/completions, /v1/models\n"
                  "• validation, OpenAI errors\n• tokenizing, SSE streaming\n• least-loaded group choice",
                  color=BLUE)

    # one Router per engine group (GPU type): draw two shadow cards behind the front one
    for off in (1.6, 0.8):
        box(ax, 44 + off, 21 - off, 62 + off, 45 - off, "", color="#c9dcef", z=1)
    router = box(ax, 44, 21, 62, 45, "Router-<group>",
                 "one deployment per GPU type\n(Router-a100, Router-l4, ...)\n\n"
                 "• Engine step loop:\n  admit → choose k → draft\n  → verify → accept → stream\n"
                 "• policy picks k from the\n  profile of its GPU type\n• bounded admission queue\n  (full → 429)\n"
                 "• metrics, health check",
                 color=BLUE)

    box(ax, 71, 17.5, 97.5, 46, "placement group (STRICT_PACK)", "the replica's worker pair, one node",
             color="#f7f7f7", dashed=True, title_size=11.5, body_size=10, z=1)
    draft = box(ax, 73, 32, 95.5, 40.5, "DraftWorker actor",
                "ModelWorker(draft) + its KV\npropose k tokens, commit", color=GREEN, title_size=12.5)
    target = box(ax, 73, 19.5, 95.5, 28, "TargetWorker actor",
                 "ModelWorker(target) + its KV\nverify k+1 positions, one forward", color=GREEN, title_size=12.5)

    store = box(ax, 44, 49.5, 62, 55.5, "ProfileStore", "profiles by GPU type, versioned",
                color=ORANGE, title_at_top=False, title_size=12.5, body_size=10)
    history = box(ax, 73, 49.5, 95.5, 55.5, "HistoryStore", "earlier outputs, per tenant",
                  color=ORANGE, title_at_top=False, title_size=12.5, body_size=10)

    # ---- outside the cluster ----------------------------------------------------------------------------
    client = box(ax, 1, 35, 14.5, 43, "Client", "openai SDK / curl", color=PURPLE, title_at_top=False)
    locust = box(ax, 1, 23, 14.5, 31, "Locust", "load shapes\n(loadtest/, k8s/locust.yaml)",
                 color=PURPLE, title_at_top=False, body_size=9.5)
    push = box(ax, 1, 48.5, 14.5, 56.5, "specserve", "profiles push FILE", color=ORANGE, title_at_top=False)
    prom = box(ax, 45, 1.5, 61, 9, "Prometheus", "scrapes Ray's metrics port", color=GREY, title_at_top=False)
    grafana = box(ax, 72, 1.5, 88, 9, "Grafana", "specserve dashboard", color=GREY, title_at_top=False)

    # ---- arrows -------------------------------------------------------------------------------------------
    arrow(ax, client.right(), ingress.left(client.cy), "HTTP\n(OpenAI API)", label_at=(18.75, client.cy + 0.6),
          both=True, size=9.5)
    arrow(ax, locust.right(), ingress.left(locust.cy), "HTTP load", label_at=(18.75, locust.cy + 0.6), size=9.5)
    arrow(ax, ingress.right(33), router.left(33), "handle\ncall,\nstreamed\nevents", label_at=(41.5, 33.6), both=True,
          size=9.5)
    arrow(ax, push.right(), store.left(push.cy), "validated profile (no restart)", label_at=(29.5, push.cy + 0.6),
          size=9.5)
    arrow(ax, store.bottom(), router.top(), "routers poll\nevery profile_poll_s", label_at=(53.6, 47.3),
          ha="left", va="center", size=9.5)
    arrow(ax, history.bottom(93), draft.top(93), "outputs pushed and pulled\nwith each poll (suffix history)",
          label_at=(92.2, 47.8), ha="right", va="center", both=True, size=9.5)
    arrow(ax, router.right(draft.cy), draft.left(), "token ids", label_at=(68, draft.cy + 0.6), both=True, size=9.5)
    arrow(ax, router.right(target.cy), target.left(), "token ids\n(+ draft probs\nwhen sampling)",
          label_at=(68, target.cy + 0.6), both=True, size=9)
    arrow(ax, router.bottom(router.cx + 1.6)[:1] + (router.y0 - 1.6,), prom.top(router.cx + 1.6), "ray_specserve_* metrics\n(batch size, k, acceptance, TTFT...)",
          label_at=(router.cx + 2.4, 12.2), ha="left", va="center", size=9.5)
    arrow(ax, prom.right(), grafana.left(), "PromQL", label_at=(66.5, prom.cy + 0.5), size=9.5)
    arrow(ax, prom.left(), locust.bottom(), "batch size and k\nduring a run", label_at=(24, 3.6), dashed=True,
          size=9.5, rad=-0.25)

    fig.subplots_adjust(left=0.005, right=0.995, bottom=0.005, top=0.995)
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("architecture.png")
    draw(out)
    print(f"wrote {out}")
