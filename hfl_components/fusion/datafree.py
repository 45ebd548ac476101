"""Data-free ensemble distillation: images synthesised from the teachers by a generator, for consortia whose server
may hold no probe pool.

DeepInversion-style synthesis matches BatchNorm statistics, which the fusable ``cnn`` / ``vgg11`` families do not
have, so this follows DENSE (Zhang et al., "DENSE: Data-Free One-Shot Federated Learning", NeurIPS 2022,
arXiv:2112.12371, Sec. 3.2, Eq. 3-6; the Co-Boosting line of work keeps the same two-player loop): a small
generator G maps noise z to images. Each round G takes ``g_steps`` steps on

    L_G = CE(ensemble(G(z)), y) - adv * KL(ensemble(G(z)) || student(G(z)))

(y: random target classes, so the synthetic images are ones the ensemble classifies confidently and the student
still gets wrong; DENSE's BatchNorm term is left out, the families here have no BatchNorm to match), then the
student takes ``s_steps`` distillation steps (:func:`hfl_components.fusion.distill.distillation_loss`) on fresh
synthetic images. Images are generated at one base size and resized (bilinear) to every teacher's and student's
input size, in [0, 1] like the sites' images.

The budget is capped twice: ``rounds`` and ``max_seconds``. Expect it to be worse than a real probe pool (the
synthetic images are far from chest X-rays); it is an option for when no public images may be used, not a default.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hfl_components.fusion.distill import distillation_loss, ensemble_probs


class Generator(nn.Module):
    """z (B, nz) -> images (B, C, S, S) in [0, 1]: Linear to 4x4, then (Upsample x2, Conv3x3, ReLU) blocks to S.

    Args:
        nz: noise dimension. channels: image channels. size: S, a power of two >= 8. width: feature maps.
    Raises:
        ValueError: S not a power of two >= 8.
    """

    def __init__(self, nz: int = 64, channels: int = 1, size: int = 32, width: int = 32):
        super().__init__()
        if size < 8 or size & (size - 1):
            raise ValueError(f"generator size must be a power of two >= 8, got {size}")
        self.nz, self.size = int(nz), int(size)
        self.fc = nn.Linear(nz, width * 16)
        blocks: list[nn.Module] = []
        s = 4
        while s < size:
            blocks += [nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv2d(width, width, 3, padding=1),
                       nn.ReLU()]
            s *= 2
        blocks += [nn.Conv2d(width, channels, 3, padding=1), nn.Sigmoid()]
        self.net = nn.Sequential(*blocks)
        self.width = int(width)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(F.relu(self.fc(z)).view(z.shape[0], self.width, 4, 4))


@dataclass
class DataFreeConfig:
    """Options of :func:`distill_data_free` (recorded with the run).

    Attributes:
        rounds: generator/student rounds (the budget cap), required: the main job's cap is the catalogue option
            ``data_free_rounds``, which the server passes. g_steps / s_steps: steps per round.
        batch_size: synthetic images per step. nz: noise dimension. base_size: generated side (power of two).
        adv: weight of the adversarial (disagreement) term. temperature: T of the soft targets.
        lr_g / lr_s: Adam learning rates. max_seconds: wall-clock cap (None: none). seed.
    """

    rounds: int
    g_steps: int = 2
    s_steps: int = 5
    batch_size: int = 32
    nz: int = 64
    base_size: int = 32
    adv: float = 1.0
    temperature: float = 2.0
    lr_g: float = 1e-3
    lr_s: float = 1e-3
    max_seconds: float | None = 60.0
    seed: int = 0


def _views(x: torch.Tensor, sizes) -> dict[int, torch.Tensor]:
    return {s: (x if x.shape[-1] == s else F.interpolate(x, size=(s, s), mode="bilinear", align_corners=False))
            for s in sizes}


def _generator_step(gen, opt_g, student, s_sizes, sizes, ens_logprob, cfg, num_classes, dev) -> torch.Tensor:
    """One generator step of DENSE's Eq. 3-5 without the BatchNorm term: CE of the ensemble on random target
    classes minus ``adv`` x the student's disagreement with the ensemble. Returns the loss."""
    z = torch.randn(cfg.batch_size, cfg.nz, device=dev)
    y = torch.randint(0, num_classes, (cfg.batch_size,), device=dev)
    views = _views(gen(z), sizes)
    lp = ens_logprob(views)
    q = lp.exp()
    adv = sum(distillation_loss(student(views[s]), q, 1.0) for s in s_sizes) / len(s_sizes)
    loss_g = F.nll_loss(lp, y) - float(cfg.adv) * adv
    opt_g.zero_grad(set_to_none=True)
    loss_g.backward()
    opt_g.step()
    return loss_g


def distill_data_free(student: nn.Module, student_sizes, teachers, weights=None, in_channels: int = 1,
                      num_classes: int = 2, config: DataFreeConfig | None = None, device=None) -> dict:
    """Distil the teachers' ensemble into ``student`` (in place) on generator images (DENSE, Zhang et al. 2022).

    Args:
        student: trained in place; left in eval mode.
        student_sizes: the student's input sizes.
        teachers: sequence of :class:`hfl_components.fusion.distill.Teacher`.
        weights: (K,) teacher weights (None: equal).
        in_channels, num_classes: of the images / models.
        config: :class:`DataFreeConfig` (required: its ``rounds`` has no default here).
        device: where it runs (None: CPU).

    Returns:
        record ``{"rounds_run", "seconds", "stopped": "budget"|"time", "last_g_loss", "last_s_loss", "config"}``.

    Raises:
        ValueError: no config, no teachers, rounds < 0.
    """
    if config is None:
        raise ValueError("distill_data_free needs a DataFreeConfig with its round budget (the main job's: the "
                         "catalogue option 'data_free_rounds')")
    cfg = config
    if int(cfg.rounds) < 0:
        raise ValueError(f"data-free rounds must be >= 0, got {cfg.rounds}")
    teachers = list(teachers)
    if not teachers:
        raise ValueError("data-free distillation needs at least one teacher")
    t0 = time.perf_counter()
    dev = torch.device(device) if device is not None else torch.device("cpu")
    torch.manual_seed(int(cfg.seed))
    gen = Generator(cfg.nz, in_channels, cfg.base_size).to(dev)
    for t in teachers:
        t.model.to(dev).eval()
        for p in t.model.parameters():
            p.requires_grad_(False)
    student.to(dev)
    s_sizes = sorted({int(s) for s in student_sizes})
    sizes = sorted(set(s_sizes) | {int(t.input_size) for t in teachers})
    opt_g = torch.optim.Adam(gen.parameters(), lr=float(cfg.lr_g))
    opt_s = torch.optim.Adam(student.parameters(), lr=float(cfg.lr_s))
    T = float(cfg.temperature)
    rec = {"rounds_run": 0, "stopped": "budget", "last_g_loss": None, "last_s_loss": None, "config": asdict(cfg)}

    def ens_logprob(views):
        z = torch.stack([t.model(views[int(t.input_size)]).float() for t in teachers])
        w = (torch.full((len(teachers),), 1.0 / len(teachers)) if weights is None
             else torch.as_tensor(weights, dtype=torch.float32)).to(z.device)
        return torch.log(torch.einsum("k,kbc->bc", w, torch.softmax(z, -1)).clamp_min(1e-12))

    try:
        for r in range(int(cfg.rounds)):
            student.eval()
            for _ in range(int(cfg.g_steps)):
                loss_g = _generator_step(gen, opt_g, student, s_sizes, sizes, ens_logprob, cfg, num_classes, dev)
            rec["last_g_loss"] = loss_g.item()
            student.train()
            for _ in range(int(cfg.s_steps)):
                with torch.no_grad():
                    views = _views(gen(torch.randn(cfg.batch_size, cfg.nz, device=dev)), sizes)
                    q = ensemble_probs([t.model(views[int(t.input_size)]).float() for t in teachers], weights, T)
                loss_s = sum(distillation_loss(student(views[s]), q, T) for s in s_sizes) / len(s_sizes)
                opt_s.zero_grad(set_to_none=True)
                loss_s.backward()
                opt_s.step()
            rec["last_s_loss"] = loss_s.item()
            rec["rounds_run"] = r + 1
            if cfg.max_seconds is not None and time.perf_counter() - t0 > float(cfg.max_seconds):
                rec["stopped"] = "time"
                break
    finally:
        for t in teachers:
            for p in t.model.parameters():
                p.requires_grad_(True)
    student.eval()
    rec["seconds"] = time.perf_counter() - t0
    return rec
