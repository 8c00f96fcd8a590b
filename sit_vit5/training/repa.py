"""REPA (representation alignment, Yu et al. 2025): the frozen encoder, the projector, the loss
and their share of the training step (:class:`RepaTraining`; the ``repa`` config section).

The backbone's hidden state after block ``repa.depth`` is projected token by token by an MLP and
pulled towards a frozen encoder's patch features of the clean image; loss = diffusion +
``repa.coeff`` × alignment. Checkpoints carry the projector; EMA weights and exports do not.
Facts from the official code (github.com/sihyun-yu/REPA at 67f7145) are cited where used.

Encoders (``repa.encoder``):

* ``digits``: ``fid.digits``' feature network (its conv2 map at the model's patch grid), for the
  digits proxy; it sees the [-1, 1] images unchanged;
* ``timm:NAME`` (or a bare timm name): pretrained timm weights (or ``repa.weights``, a local
  state-dict file); needs timm;
* ``hub:REPO:ENTRY``: ``torch.hub.load(REPO, ENTRY)``, e.g.
  ``hub:facebookresearch/dinov2:dinov2_vitb14``, REPA's own encoder;
* a local folder in timm's Hugging Face layout (``config.json`` + ``model.safetensors``).

Shapes: B batch, T patch tokens, D backbone width, E encoder feature width. The projector has its
own AdamW and generator (seeded by ``train.seed``), so with ``repa.coeff=0`` the model trains bit
for bit as without REPA.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import Config
from ..names import INTERPOLATIONS as INTERPOLATIONS  # REPA's resize modes
from ..transport.rng import mix_seed
from ..utils import hub_access
from ..utils.errors import ConfigError
from ..utils.precision import autocast
from .checkpoint import IncompatibleCheckpointError
from .optim import param_groups

#: ImageNet mean / std: REPA normalises DINOv2's input with timm's IMAGENET_DEFAULT_* (train.py)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
DIGITS = "digits"
SALT_REPA = 0x4E9A  # the projector's init stream, apart from the model's (the global RNG)
METRICS = ("loss_diffusion", "loss_repa")  # the log's columns: diffusion loss, alignment loss


# ----------------------------------------------------------------------------- projector and loss


class Projector(nn.Sequential):
    """REPA's projector (``build_mlp``): Linear(D, P), SiLU, Linear(P, P), SiLU, Linear(P, E)
    per token, (B, T, D) -> (B, T, E); P = 2048 in REPA."""

    def __init__(self, hidden_size: int, projector_dim: int, feature_dim: int) -> None:
        super().__init__(nn.Linear(hidden_size, projector_dim), nn.SiLU(),
                         nn.Linear(projector_dim, projector_dim), nn.SiLU(),
                         nn.Linear(projector_dim, feature_dim))

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> Projector:
        """SiT's Linear init (xavier-uniform, zero biases) from ``generator``."""
        for layer in self:
            if isinstance(layer, nn.Linear):
                nn.init.xavier_uniform_(layer.weight, generator=generator)
                nn.init.zeros_(layer.bias)
        return self


def alignment_loss(projected: Tensor, features: Tensor) -> Tensor:
    """REPA's loss per image (B,): the mean over the T tokens of ``-cos(projected, features)``
    (``loss.py``: both L2-normalised along the feature axis), in fp32; inputs (B, T, E)."""
    if projected.shape != features.shape:
        raise ConfigError(f"projected hidden states {tuple(projected.shape)} and encoder features "
                          f"{tuple(features.shape)} differ in shape")
    h = F.normalize(projected.float(), dim=-1)
    z = F.normalize(features.float(), dim=-1)
    return -(h * z).sum(dim=-1).mean(dim=-1)


class HiddenCapture:
    """The patch tokens (B, T, D) after block ``depth`` (1-based, REPA's ``(i + 1) ==
    encoder_depth``), read by a forward hook from the training forward; extra tokens dropped.
    Only forwards inside :meth:`armed` are recorded (not gradient checkpointing's recompute).
    """

    def __init__(self, model: nn.Module, depth: int) -> None:
        blocks = getattr(model, "blocks", None)
        if blocks is None or not 1 <= depth <= len(blocks):
            count = "no" if blocks is None else len(blocks)
            raise ConfigError(f"repa.depth={depth}: the model has {count} blocks; choose "
                              f"1..{count} (REPA: 8 of SiT-XL/2's 28)")
        self.depth, self.extra_tokens = depth, model.num_registers
        self._armed, self._hidden, self._calls = False, None, 0
        self._handle = blocks[depth - 1].register_forward_hook(self._store)

    def _store(self, module: nn.Module, args: tuple, output: Tensor) -> None:
        if self._armed:
            self._hidden = output[:, : output.shape[1] - self.extra_tokens]
            self._calls += 1

    @contextmanager
    def armed(self) -> Iterator[None]:
        """Record the forwards run inside; :meth:`take` then returns the hidden state."""
        self._armed, self._hidden, self._calls = True, None, 0
        try:
            yield
        finally:
            self._armed = False

    def take(self) -> Tensor:
        """The recorded hidden patch tokens (B, T, D), part of the autograd graph; cleared."""
        hidden, calls, self._hidden = self._hidden, self._calls, None
        if calls != 1 or hidden is None:
            raise RuntimeError(f"REPA reads the hidden state of one forward per loss; the loss ran "
                               f"{calls} forwards of block {self.depth}")
        return hidden

    def remove(self) -> None:
        self._handle.remove()


# ----------------------------------------------------------------------------- encoders


class DigitsTokens(nn.Module):
    """``fid.digits``' DigitsNet as a patch-token encoder: images (B, 1, R, R) in [-1, 1] -> its
    ReLU conv2 map (B, 64, h, w), before (8×8) or after (``pooled``, 4×4) its last max-pool."""

    def __init__(self, net: nn.Module, pooled: bool) -> None:
        super().__init__()
        self.net, self.pooled = net, pooled

    def forward(self, x: Tensor) -> Tensor:
        net = self.net
        x = F.relu(net.conv1(x))
        if net.resolution == 16:  # DigitsNet.features: the 16×16 network pools once more first
            x = F.max_pool2d(x, 2)
        x = F.relu(net.conv2(x))
        return F.max_pool2d(x, 2) if self.pooled else x


class FrozenEncoder(nn.Module):
    """A frozen encoder with its preprocessing: images (B, C, H, W) in [-1, 1] -> patch features
    (B, T, E), no gradients. Preprocessing (REPA's ``preprocess_raw_image``): to [0, 1],
    normalised with ``mean`` / ``std``, resized to ``resolution``; gray repeated to 3 channels.
    ``unit_range=False`` feeds [-1, 1] unchanged; ``prefix_tokens`` are dropped.
    """

    def __init__(self, net: nn.Module, name: str, *, resolution: tuple[int, int] | None,
                 mean: Sequence[float] | None, std: Sequence[float] | None,
                 interpolation: str = "bicubic", unit_range: bool = True, prefix_tokens: int = 0,
                 in_chans: int | None = None) -> None:
        super().__init__()
        self.net = net.eval().requires_grad_(False)
        self.name, self.resolution, self.interpolation = name, resolution, interpolation
        self.unit_range, self.prefix_tokens, self.in_chans = unit_range, prefix_tokens, in_chans
        self.mean = None if mean is None else tuple(float(m) for m in mean)
        self.std = None if std is None else tuple(float(s) for s in std)
        self.feature_dim = 0  # E, set by load_encoder's dry run
        self.eval()

    def train(self, mode: bool = True) -> FrozenEncoder:
        return super().train(False)  # frozen: dropout and norms stay in inference mode

    def preprocess(self, images: Tensor) -> Tensor:
        """(B, C, H, W) in [-1, 1] -> the encoder's input."""
        x = images.float()
        if self.in_chans is not None and x.shape[1] != self.in_chans:
            if x.shape[1] != 1:
                raise ConfigError(f"repa.encoder={self.name} takes {self.in_chans}-channel images, "
                                  f"the data gives {x.shape[1]}")
            x = x.expand(-1, self.in_chans, -1, -1)
        if self.unit_range:
            x = (x + 1) / 2
        if self.mean is not None:  # REPA: Normalize first, then the resize
            shape = (1, -1, 1, 1)
            mean = torch.tensor(self.mean, device=x.device).view(shape)
            std = torch.tensor(self.std, device=x.device).view(shape)
            x = (x - mean) / std
        if self.resolution is not None and tuple(x.shape[-2:]) != self.resolution:
            x = F.interpolate(x, size=self.resolution, mode=self.interpolation)
        return x

    @torch.no_grad()
    def forward(self, images: Tensor) -> Tensor:
        return self.tokens(self.net_output(self.preprocess(images)))

    def net_output(self, x: Tensor) -> Any:
        net = self.net
        return net.forward_features(x) if hasattr(net, "forward_features") else net(x)

    def tokens(self, out: Any) -> Tensor:
        """The encoder's output as patch tokens (B, T, E): DINOv2's ``x_norm_patchtokens``, a token
        sequence without its prefix tokens, or a feature map (B, E, h, w) flattened row by row."""
        if isinstance(out, dict):
            if "x_norm_patchtokens" not in out:
                raise ConfigError(f"repa.encoder={self.name}: forward_features returned a dict "
                                  "without 'x_norm_patchtokens' (keys: "
                                  f"{', '.join(map(str, out))})")
            return out["x_norm_patchtokens"]  # DINOv2: patch tokens only, after its final norm
        if out.ndim == 4:
            return out.flatten(2).transpose(1, 2)
        if out.ndim != 3:
            raise ConfigError(f"repa.encoder={self.name} gives features of shape "
                              f"{tuple(out.shape)}; need tokens (B, T, E) or a map (B, E, h, w)")
        return out[:, self.prefix_tokens:]

    @torch.no_grad()
    def token_grid(self, channels: int, image_size: tuple[int, int], device: torch.device
                   ) -> tuple[int, int, int]:
        """(T, E, side or 0) for images (1, channels, *image_size): token count, feature width and
        the grid side when T is a square (a dry run on zeros)."""
        z = self(torch.zeros(1, channels, *image_size, device=device))
        side = math.isqrt(z.shape[1])
        return z.shape[1], z.shape[2], side if side * side == z.shape[1] else 0

    def patch_size(self) -> int | None:
        """The encoder's patch side, when it is a ViT (timm's or DINOv2's ``patch_embed``)."""
        patch = getattr(getattr(self.net, "patch_embed", None), "patch_size", None)
        if patch is None:
            patch = getattr(self.net, "patch_size", None)
        if isinstance(patch, (tuple, list)):
            patch = patch[0] if len(set(patch)) == 1 else None
        return int(patch) if isinstance(patch, int) else None

    def weights_sha256(self) -> str:
        """SHA-256 of the encoder's weights (names, dtypes, shapes, bytes), checked on resume."""
        digest = hashlib.sha256()
        for name, tensor in sorted(self.net.state_dict().items()):
            t = tensor.detach().cpu().contiguous()
            digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
            digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()


def _first_conv_channels(net: nn.Module) -> int | None:
    conv = next((m for m in net.modules() if isinstance(m, nn.Conv2d)), None)
    return None if conv is None else conv.in_channels


def _import_timm(spec: str):
    try:
        import timm
    except ImportError:
        raise ConfigError(f"repa.encoder={spec} needs timm: pip install timm "
                          "(or pip install 'sit-vit5[repa]')") from None
    return timm


def _offline_hint(err: BaseException) -> bool:
    text = f"{type(err).__name__} {err}".lower()
    words = ("offline", "connect", "resolve", "network", "urlopen", "localentrynotfound",
             "cannot find the requested files", "max retries", "timed out", "name or service")
    return any(w in text for w in words)


def _timm_encoder(spec: str, name: str, weights: str | None) -> tuple[nn.Module, dict[str, Any]]:
    """(network, its pretrained cfg) of a timm name, ``hf-hub:`` id or local timm folder
    (``local-dir:``); ``weights``: a local state-dict file instead of the pretrained weights."""
    timm = _import_timm(spec)
    named = not name.startswith(("local-dir:", "hf-hub:"))
    if named and not timm.is_model(name):
        raise ConfigError(f"repa.encoder={spec}: {name!r} is not a timm model name "
                          "(timm.list_models() lists them)")
    pretrained = weights is None
    if pretrained and not name.startswith("local-dir:"):
        hub_access.is_offline()  # unreachable: offline mode now, so timm looks in the cache only
    try:
        with hub_access.quiet_hub_logs():
            net = timm.create_model(name, pretrained=pretrained, num_classes=0)
    except Exception as err:  # noqa: BLE001  timm/hf raise many kinds; the offline ones get a hint
        if name.startswith("local-dir:") or not _offline_hint(err):
            raise ConfigError(f"repa.encoder={spec}: timm could not build it ({err})") from err
        hub_id = name.removeprefix("hf-hub:")
        if named:
            hub_id = getattr(timm.models.get_pretrained_cfg(name), "hf_hub_id", None) or name
        raise ConfigError(
            f"repa.encoder={spec}: its weights are not in the local cache and "
            f"{hub_access.offline_reason()} ({type(err).__name__}); download them once online "
            f"(hf download {hub_id}, or python -c \"import timm; "
            f"timm.create_model('{name}', pretrained=True)\"), or pass a local folder / "
            "repa.weights") from err
    if weights is not None:  # every weight of the network; only a classifier head may be left over
        found = net.load_state_dict(_read_state_dict(weights, spec), strict=False)
        heads = ("head.", "fc.", "classifier.")
        extra = [k for k in found.unexpected_keys if not k.startswith(heads)]
        if found.missing_keys or extra:
            bad = found.missing_keys[:3] or extra[:3]
            raise ConfigError(f"repa.weights={weights} does not fit repa.encoder={spec}: "
                              f"{len(found.missing_keys)} missing and {len(extra)} unexpected keys "
                              f"(e.g. {', '.join(bad)})")
    return net, dict(getattr(net, "pretrained_cfg", None) or {})


def _read_state_dict(path: str, spec: str) -> dict[str, Tensor]:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"repa.weights={path}: no such file (a state dict for "
                          f"repa.encoder={spec})")
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(file))
    state = torch.load(file, map_location="cpu", weights_only=True)
    return state.get("state_dict", state.get("model", state)) if isinstance(state, dict) else state


def _cached_hub_checkout(repo: str) -> Path | None:
    """torch.hub's cached checkout of ``owner/name[:ref]`` (``<hub dir>/owner_name_ref``; without a
    ref, main then master as torch.hub tries them), None when there is none."""
    name, _, ref = repo.partition(":")
    stem = name.replace("/", "_")
    refs = [ref.replace("/", "_")] if ref else ["main", "master"]
    found = [Path(torch.hub.get_dir()) / f"{stem}_{r}" for r in refs]
    return next((path for path in found if (path / "hubconf.py").is_file()), None)


def _hub_encoder(spec: str, target: str) -> nn.Module:
    repo, sep, entry = target.rpartition(":")
    if not sep or not repo or not entry:
        raise ConfigError(f"repa.encoder={spec}: expected hub:OWNER/REPO:ENTRY (e.g. "
                          "hub:facebookresearch/dinov2:dinov2_vitb14) or hub:/local/repo:ENTRY")
    source = "local" if Path(repo).is_dir() else "github"
    if source == "github" and hub_access.is_offline(hub_access.GITHUB):
        cached = _cached_hub_checkout(repo)
        if cached is None:
            raise ConfigError(
                f"repa.encoder={spec}: no cached copy of {repo} in {torch.hub.get_dir()} and "
                f"{hub_access.offline_reason(hub_access.GITHUB)}; run once online: python -c "
                f"\"import torch; torch.hub.load('{repo}', '{entry}')\", or pass "
                "hub:/path/to/checkout:ENTRY")
        repo, source = str(cached), "local"  # torch.hub would ask GitHub for the branch first
    try:  # trust_repo: the config names the repository explicitly; no interactive prompt on a job
        net = torch.hub.load(repo, entry, source=source, trust_repo=True)
    except Exception as err:  # noqa: BLE001
        if source == "local" or not _offline_hint(err):
            raise ConfigError(f"repa.encoder={spec}: torch.hub could not load it ({err})") from err
        raise ConfigError(
            f"repa.encoder={spec}: torch.hub cannot reach GitHub and has no cached copy "
            f"({type(err).__name__}); run once online: python -c \"import torch; "
            f"torch.hub.load('{repo}', '{entry}')\" (fills {torch.hub.get_dir()}), or pass "
            "hub:/path/to/checkout:ENTRY") from err
    if hasattr(net, "head"):  # REPA: del encoder.head; encoder.head = Identity()
        net.head = nn.Identity()
    return net


def _resample_pos_embed(net: nn.Module, grid: tuple[int, int], spec: str) -> None:
    """REPA resamples DINOv2's position table once to the token grid (timm's
    ``resample_abs_pos_embed``); DINOv2's own forward then uses it unchanged."""
    table = getattr(net, "pos_embed", None)
    if not isinstance(table, Tensor) or table.ndim != 3:
        return
    n = table.shape[1]
    prefix = 1 if math.isqrt(n - 1) ** 2 == n - 1 else 0  # DINOv2: the class token's entry first
    side = math.isqrt(n - prefix)
    if side * side != n - prefix or (side, side) == tuple(grid):
        return
    timm = _import_timm(spec)
    resampled = timm.layers.resample_abs_pos_embed(table.data, list(grid), num_prefix_tokens=prefix)
    net.pos_embed = nn.Parameter(resampled, requires_grad=False)


def _digits_encoder(image_size: int, grid: tuple[int, int]) -> FrozenEncoder:
    from fid.digits import TRAIN_CONFIGS, load_digits_net

    if image_size not in TRAIN_CONFIGS:
        raise ConfigError(f"repa.encoder=digits: the digits feature network exists at "
                          f"{', '.join(map(str, TRAIN_CONFIGS))} px; data.image_size={image_size}")
    maps = {(image_size // (2 if image_size == 16 else 1),) * 2: False,
            (image_size // (4 if image_size == 16 else 2),) * 2: True}  # pre-pool, post-pool
    pooled = maps.get(tuple(grid), True)  # no match: the grid check names both
    net = DigitsTokens(load_digits_net(resolution=image_size), pooled)
    return FrozenEncoder(net, DIGITS, resolution=None, mean=None, std=None, unit_range=False,
                         in_chans=1)


def _timm_name(spec: str) -> str:
    """timm's name for ``spec``: ``timm:NAME`` and bare names as they are, a folder as
    ``local-dir:``; a path that does not exist is refused."""
    if spec.startswith("timm:"):
        return spec.removeprefix("timm:")
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"repa.encoder={spec}: a local encoder folder needs timm's "
                              "config.json and weights (timm.models.save_for_hf writes them)")
        return f"local-dir:{path}"
    if path.exists() or spec.startswith(("/", ".", "~")):
        raise ConfigError(f"repa.encoder={spec}: not a folder in timm's layout (config.json + "
                          "weights); a weights file goes to repa.weights with "
                          "repa.encoder=timm:ARCH")
    return spec


def load_encoder(cfg_repa: dict[str, Any], image_size: int, grid: tuple[int, int],
                 channels: int, device: torch.device | str = "cpu") -> FrozenEncoder:
    """The frozen encoder ``cfg_repa`` names, set up for images (B, ``channels``, ``image_size``,
    ``image_size``) and the model's patch ``grid`` (rows, cols); ConfigError when its token grid
    differs or it cannot be loaded (offline: naming what to download)."""
    spec, weights = cfg_repa["encoder"], cfg_repa.get("weights")
    resolution, mean, std = cfg_repa.get("resolution"), cfg_repa.get("mean"), cfg_repa.get("std")
    interpolation = cfg_repa.get("interpolation") or "bicubic"
    if spec == DIGITS:
        encoder = _digits_encoder(image_size, grid)
        if resolution not in (None, image_size) or mean is not None or std is not None:
            raise ConfigError("repa.encoder=digits sees the [-1, 1] images as the FID network "
                              "does: leave repa.resolution, repa.mean and repa.std unset")
    else:
        prefix = 0
        if spec.startswith("hub:"):
            net, pretrained_cfg = _hub_encoder(spec, spec[4:]), {}
            prefix = 1 + int(getattr(net, "num_register_tokens", 0) or 0)
        else:
            name = _timm_name(spec)
            net, pretrained_cfg = _timm_encoder(spec, name, weights)
            prefix = int(getattr(net, "num_prefix_tokens", 0) or 0)
        in_chans = _first_conv_channels(net)
        mean = mean if mean is not None else pretrained_cfg.get("mean", IMAGENET_MEAN)
        std = std if std is not None else pretrained_cfg.get("std", IMAGENET_STD)
        encoder = FrozenEncoder(net, spec, resolution=None, mean=mean, std=std,
                                interpolation=interpolation, prefix_tokens=prefix,
                                in_chans=in_chans)
        patch = encoder.patch_size()
        if resolution is None:  # REPA's 224 for DINOv2/14 at 256 px: the patch grid of the model
            if patch is None:
                raise ConfigError(f"repa.encoder={spec} is not a ViT with a known patch size: set "
                                  "repa.resolution to the input side that gives the model's grid")
            size = (patch * grid[0], patch * grid[1])
        else:
            size = (resolution, resolution)
        if patch is not None and hasattr(net, "set_input_size"):  # timm ViTs: resample once
            if tuple(net.patch_embed.img_size) != size:
                net.set_input_size(img_size=size)
        elif spec.startswith("hub:") and patch is not None:
            _resample_pos_embed(net, (size[0] // patch, size[1] // patch), spec)
        encoder.resolution = size
    encoder = encoder.to(device)
    tokens, width, side = encoder.token_grid(channels, (image_size,) * 2, torch.device(device))
    if tokens != grid[0] * grid[1]:
        at = (f" at {encoder.resolution[0]}×{encoder.resolution[1]} px" if encoder.resolution
              else "")
        shape = f"{side}×{side}" if side else "not square"
        fix = (f"; set repa.resolution={encoder.patch_size() * grid[0]}"
               if encoder.patch_size() and spec != DIGITS else "")
        if spec == DIGITS:
            fix = "; its maps are 8×8 and 4×4: choose model.patch_size for one of them"
        raise ConfigError(f"repa.encoder={spec}: the encoder gives {tokens} patch tokens "
                          f"({shape}){at} but the model has {grid[0] * grid[1]} "
                          f"({grid[0]}×{grid[1]}){fix}")
    encoder.feature_dim = width
    return encoder


# ----------------------------------------------------------------------------- in the training loop


class RepaTraining:
    """REPA's state and step pieces for the bare ``model`` (before DDP / FSDP); ``channels``: the
    data's image channels. The projector has its own AdamW (equal to REPA's single optimizer)."""

    metric_names = METRICS  # the columns it adds to the metric log

    def __init__(self, cfg: Config, model: nn.Module, channels: int, device: torch.device) -> None:
        r, o = cfg["repa"], cfg["optim"]
        self.device, self.precision = device, cfg["train"]["precision"]
        self.coeff, self.depth = float(r["coeff"]), r["depth"]
        self.capture = HiddenCapture(model, r["depth"])
        self.encoder: FrozenEncoder = load_encoder(r, cfg["data"]["image_size"], model.grid,
                                                   channels, device)
        generator = torch.Generator().manual_seed(mix_seed(cfg["train"]["seed"], SALT_REPA))
        hidden = model.hidden_size  # D
        self.projector = Projector(hidden, r["projector_dim"], self.encoder.feature_dim)
        self.projector.reset_parameters(generator).to(device).train()
        self.optimizer = torch.optim.AdamW(param_groups(self.projector, o["weight_decay"]),
                                           lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"])
        self.encoder_sha256 = self.encoder.weights_sha256()
        self._sums = torch.zeros(2, device=device)  # diffusion, alignment: sums over micro-batches
        self.last_metrics: dict[str, float] = {}

    def describe(self) -> str:
        n = sum(p.numel() for p in self.projector.parameters())
        return (f"REPA: {self.encoder.name} ({self.encoder.feature_dim}-d) at block {self.depth}, "
                f"coeff {self.coeff:g}, projector {n / 1e6:.2f}M parameters")

    def features(self, images: Tensor) -> Tensor:
        """Patch features (B, T, E) of clean images (B, C, H, W) in [-1, 1], under autocast."""
        with torch.no_grad(), autocast(self.device, self.precision):
            return self.encoder(images)

    def loss(self, per_sample_loss: Callable[[], Tensor], features: Tensor) -> Tensor:
        """``per_sample_loss()`` (the objective's (B,) loss, one model forward) plus ``coeff`` times
        the alignment of its hidden state with ``features``; returns the scalar to backpropagate."""
        with self.capture.armed():
            diffusion = per_sample_loss()
        with autocast(self.device, self.precision):
            projected = self.projector(self.capture.take())
        alignment = alignment_loss(projected, features)
        d, a = diffusion.mean(), alignment.mean()
        self._sums += torch.stack([d.detach().float(), a.detach()])
        return d + self.coeff * a

    def parameters(self) -> list[nn.Parameter]:
        return list(self.projector.parameters())

    def zero_grad(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)

    def sync_gradients(self, world_size: int) -> None:
        """Average the projector's gradients over the processes (DDP's semantics), in one call."""
        if world_size == 1:
            return
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        grads = [p.grad for p in self.parameters()]
        flat = _flatten_dense_tensors(grads)
        torch.distributed.all_reduce(flat)
        flat /= world_size
        for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            grad.copy_(synced)

    def clip_jointly(self, model_grads: list[Tensor], model_norm: float, max_norm: float) -> float:
        """Clip the model's (``model_grads``: local shards included) and the projector's gradients
        to one global norm ``hypot(model_norm, projector norm)``, as ``clip_grad_norm_``; returns
        it (exactly ``model_norm`` when the projector's gradient is zero)."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        own = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        total = math.sqrt(model_norm * model_norm + own * own)  # float64: sqrt(m*m) == m, fp32 m
        total_t = torch.tensor(total, dtype=torch.float32, device=self.device)
        coef = torch.clamp(max_norm / (total_t + 1e-6), max=1.0)  # clip_grads_with_norm_'s formula
        if model_grads:
            torch._foreach_mul_(model_grads, coef.to(model_grads[0].device))
        if grads:
            torch._foreach_mul_(grads, coef)
        return float(total_t)

    def step(self, scaler: torch.amp.GradScaler | None) -> None:
        if scaler is not None:
            scaler.step(self.optimizer)
        else:
            self.optimizer.step()

    def step_metrics(self, reduce: Callable[..., Tensor], accum: int) -> dict[str, float]:
        """The step's all-process means of the two loss parts (``reduce``: accelerate's; resets)."""
        means = reduce(self._sums / accum, reduction="mean").tolist()
        self._sums.zero_()
        self.last_metrics = dict(zip(METRICS, means))
        return self.last_metrics

    def state_dict(self) -> dict[str, Any]:
        return {"projector": self.projector.state_dict(), "opt": self.optimizer.state_dict(),
                "encoder_sha256": self.encoder_sha256}

    def load_state_dict(self, state: dict[str, Any] | None, path: Any) -> None:
        """Restore a checkpoint's ``repa`` entry (IncompatibleCheckpointError: none / another)."""
        if state is None:
            raise IncompatibleCheckpointError(f"cannot resume from {path} with repa.encoder set: "
                                              "it holds no REPA projector (trained without REPA)")
        if state.get("encoder_sha256") != self.encoder_sha256:
            raise IncompatibleCheckpointError(
                f"cannot resume from {path}: repa.encoder={self.encoder.name} has other weights "
                f"(SHA-256 {self.encoder_sha256[:12]}) than the encoder the run was trained with "
                f"({str(state.get('encoder_sha256'))[:12]})")
        try:
            self.projector.load_state_dict(state["projector"])
        except RuntimeError as err:
            raise ConfigError(f"cannot resume from {path}: its REPA projector does not fit "
                              f"({str(err).splitlines()[0]})") from None
        self.optimizer.load_state_dict(state["opt"])
