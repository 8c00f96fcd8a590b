"""2-D rotary position embedding, EVA/ViT-5 formulation.

Per head, the first half of the channels rotates with the row index and the second half with the
column index. Per axis (d = head_dim / 2 channels): ``freqs = theta^(-arange(0, d, 2) / d)``, each
frequency repeated for an adjacent channel pair, rotation ``x * cos + rotate_half(x) * sin`` with
``rotate_half((a, b)) = (-b, a)``. Positions are ``arange(n) / n * n_train`` so any grid size is
mapped onto the training range.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .kernels import Rotation


def rotate_half(x: Tensor) -> Tensor:
    """(..., 2k) -> (..., 2k): each adjacent pair (a, b) becomes (-b, a)."""
    a, b = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((-b, a), dim=-1).flatten(-2)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x (B, H, N, head_dim) by per-token angles; cos/sin (N, head_dim) broadcast over B, H.

    The defining formula; the models use :class:`Rotation`, which computes the same numbers faster.
    """
    return x * cos + rotate_half(x) * sin


def register_grid(num_registers: int) -> tuple[int, int]:
    """The (side, side) grid registers rotate on (a square count: see
    ``switches.check_architecture``)."""
    side = math.isqrt(num_registers)
    return side, side


def axis_positions(n: int, n_train: int) -> Tensor:
    """Positions (n,) float64 of an n-long axis, rescaled onto a model trained with n_train."""
    return torch.arange(n, dtype=torch.float64) / n * n_train  # on cpu: angles, cached per device


def rope_angles_2d(
    head_dim: int, theta: float, grid: tuple[int, int], train_grid: tuple[int, int]
) -> Tensor:
    """Rotation angles (h*w, head_dim) in float64 for a row-major (h, w) token grid; head_dim a
    multiple of 4."""
    d = head_dim // 2
    exponents = -torch.arange(0, d, 2, dtype=torch.float64) / d  # on cpu: angles
    freqs = (theta**exponents).repeat_interleave(2)
    (h, w), (h0, w0) = grid, train_grid
    rows = axis_positions(h, h0)[:, None] * freqs  # (h, d)
    cols = axis_positions(w, w0)[:, None] * freqs  # (w, d)
    both = torch.cat([rows[:, None].expand(h, w, d), cols[None].expand(h, w, d)], dim=-1)
    return both.reshape(h * w, head_dim)  # (h, w, 2d) -> (h*w, head_dim)


class RopeTables(nn.Module):
    """cos/sin tables for patches (+ registers on their own grid and theta), cached per grid,
    device and dtype.

    Tokens are ordered [patches (row-major), registers]. Registers without their own RoPE get the
    identity rotation (cos 1, sin 0); patches without RoPE likewise, so one table covers the whole
    sequence.

    A module only for its two non-persistent buffers ``train_cos``/``train_sin`` (N, head_dim),
    fp32, the training grid's tables: they move with ``model.to(device)`` and FSDP, are copied by
    deepcopy (the EMA), and stay out of the state dict (checkpoints keep their keys). A compiled
    forward reads them and casts them in its graph; eager code keeps the per (grid, device, dtype)
    cache.
    """

    def __init__(
        self, head_dim: int, train_grid: tuple[int, int], theta: float | None = 10000.0,
        num_registers: int = 0, register_theta: float | None = 100.0,
    ) -> None:
        super().__init__()
        self.head_dim, self.train_grid, self.theta = head_dim, train_grid, theta
        self.num_registers, self.register_theta = num_registers, register_theta
        self.register_grid = register_grid(num_registers)
        # (grid, device, dtype) -> (cos, sin), and -> the Rotation (rebuilt if its tables change)
        self._cache: dict[tuple, tuple[Tensor, Tensor]] = {}
        self._rotations: dict[tuple, Rotation] = {}
        # fp32, not float64: a float64 -> bf16/fp16 cast rounds through fp32 anyway (c10's half
        # types convert from float), so casting these gives the eager cache's bits (but for fp64)
        ang = self.angles(train_grid)
        self.register_buffer("train_cos", ang.cos().float(), persistent=False)
        self.register_buffer("train_sin", ang.sin().float(), persistent=False)

    def angles(self, grid: tuple[int, int]) -> Tensor:
        """Angles (h*w + num_registers, head_dim), float64."""
        n = grid[0] * grid[1]
        if self.theta is not None:
            patches = rope_angles_2d(self.head_dim, self.theta, grid, self.train_grid)
        else:
            patches = torch.zeros(n, self.head_dim, dtype=torch.float64)  # on cpu: angles
        if self.register_theta is not None and self.num_registers:
            rgrid = self.register_grid
            regs = rope_angles_2d(self.head_dim, self.register_theta, rgrid, rgrid)
        else:
            regs = torch.zeros(  # on cpu: angles
                self.num_registers, self.head_dim, dtype=torch.float64)
        return torch.cat([patches, regs])

    def _buffered(self, grid: tuple[int, int], device: torch.device, dtype: torch.dtype) -> bool:
        """Whether the buffers give this grid's tables exactly: the training grid, buffers still
        fp32 (``model.to(torch.bfloat16)`` would have rounded them) on ``device``, a dtype cast from
        fp32 as from float64 (fp32, bf16, fp16; not fp64)."""
        return (grid == self.train_grid and self.train_cos.dtype == torch.float32
                and self.train_cos.device == device
                and dtype in (torch.float32, torch.bfloat16, torch.float16))

    def tables(
        self, grid: tuple[int, int], device: torch.device, dtype: torch.dtype
    ) -> tuple[Tensor, Tensor]:
        """(cos, sin), each (h*w + num_registers, head_dim), built once per grid, device, dtype."""
        if torch.compiler.is_compiling():  # a cache lookup would be a guard: a recompile once full
            if self._buffered(grid, device, dtype):  # on the device already: cast in the graph
                return self.train_cos.to(dtype), self.train_sin.to(dtype)
            # other grids: built in the graph (float64 on the host, then a host-to-device copy)
            ang = self.angles(grid)
            return ang.cos().to(device, dtype), ang.sin().to(device, dtype)
        key = (grid, device, dtype)
        if key not in self._cache:
            ang = self.angles(grid)
            self._cache[key] = (ang.cos().to(device, dtype), ang.sin().to(device, dtype))
        return self._cache[key]

    def forward(self, grid: tuple[int, int], device: torch.device, dtype: torch.dtype) -> Rotation:
        """The cached :class:`Rotation` for this grid, device and dtype."""
        cos, sin = self.tables(grid, device, dtype)
        # bf16/fp16 tables come with their fp32 ones: the fused QK-norm + RoPE (CPU node, GPU ops)
        # rotates in fp32
        half = dtype in (torch.bfloat16, torch.float16)
        if torch.compiler.is_compiling():  # no Python-side cache mutation inside a traced graph
            fp32 = self.tables(grid, device, torch.float32) if half else None
            return Rotation(cos, sin, fp32, complex_tables=False)
        key = (grid, device, dtype)
        rotation = self._rotations.get(key)
        if rotation is None or rotation.source[0] is not cos or rotation.source[1] is not sin:
            fp32 = self.tables(grid, device, torch.float32) if half else None
            rotation = self._rotations[key] = Rotation(cos, sin, fp32)
        return rotation
