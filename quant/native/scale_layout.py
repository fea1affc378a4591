"""The block-scale layout of native NVFP4 GEMMs (cuBLASLt, ``torch.nn.functional.scaled_mm``).

A native NVFP4 GEMM ``D = α · (A · Bᵀ)`` takes each operand as packed E2M1 codes,
``rows × K/2`` bytes with element ``2i`` in the low nibble and ``2i+1`` in the high nibble (the
order of :class:`~quant.format.PackedNVFP4` and of ``torch.float4_e2m1fn_x2``), and its E4M3
block scales (one per 16 elements along K, ``CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3``) not
row-major but in the tiled layout of the cuBLAS documentation, section "1D Block Scaling
Factors Layout" (https://docs.nvidia.com/cuda/cublas/index.html#d-block-scaling-factors-layout);
torch calls the same layout ``SwizzleType.SWIZZLE_32_4_4`` for ``ScalingType.BlockWise1x16``
scales. The layout, for a ``rows × scale_cols`` scale matrix (``scale_cols = K / 16``):

1. pad to ``rows_padded = 128·⌈rows/128⌉`` rows and ``cols_padded = 4·⌈scale_cols/4⌉`` columns;
2. cut the padded matrix into 128×4 tiles (512 bytes each) and store the tiles one after the
   other, row-major over tiles: tile ``(i, j)`` (rows ``128i…128i+127``, scale columns
   ``4j…4j+3``) starts at byte ``512 · (i · cols_padded/4 + j)``;
3. inside a tile, the scale at tile-local ``(r, c)`` (``0 ≤ r < 128``, ``0 ≤ c < 4``) is at byte
   ``(r % 32) · 16 + (r // 32) · 4 + c``: the tile is a 32×16 byte matrix whose row ``r % 32``
   holds, for each of the four 32-row slices ``r // 32``, that row's four scales.

Padding gets the value 0 (byte ``0x00``, E4M3 +0). It does not change the product: a padded
row ``r ≥ rows`` only scales elements of output rows (or columns) that do not exist, which the
kernel never writes; a padded scale column only scales elements ``k ≥ K`` of the padded
reduction, whose E2M1 codes :func:`native_operands` sets to 0 (+0), so each contributes
``0 · 0 = 0`` exactly (both factors finite, no NaN).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..format import GROUP, PackedNVFP4

TILE_ROWS = 128
"""Rows of one scale tile."""

TILE_COLS = 4
"""Scale columns of one scale tile (4 scales · 16 elements = 64 elements of K)."""

TILE_BYTES = TILE_ROWS * TILE_COLS
"""Bytes of one tile (one byte per E4M3 scale)."""

K_ALIGN = GROUP * TILE_COLS
"""The reduction length one tile column covers: K is padded to a multiple of 64."""


def _ceil_to(n: int, m: int) -> int:
    return -(-n // m) * m


def padded_shape(rows: int, scale_cols: int) -> tuple[int, int]:
    """``(rows_padded, cols_padded)``: ``rows`` rounded up to a multiple of 128 and ``scale_cols``
    to a multiple of 4 (cuBLAS, "1D Block Scaling Factors Layout")."""
    for name, v in (("rows", rows), ("scale_cols", scale_cols)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be a non-negative int, got {v!r}")
    return _ceil_to(rows, TILE_ROWS), _ceil_to(scale_cols, TILE_COLS)


def _as_bytes(scales: torch.Tensor, what: str) -> torch.Tensor:
    """View a tensor of 1-byte elements (uint8, int8, float8_*) as uint8 (pad, permute and
    scatter are then plain byte moves, whatever torch implements for float8)."""
    if not isinstance(scales, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, got {type(scales).__name__}")
    if scales.element_size() != 1 or scales.dtype == torch.bool:
        raise ValueError(
            f"{what} must have 1-byte elements (torch.float8_e4m3fn for NVFP4, or uint8), "
            f"got {scales.dtype}"
        )
    return scales if scales.dtype == torch.uint8 else scales.view(torch.uint8)


def _check_matrix(scales: torch.Tensor, what: str) -> None:
    if scales.dim() != 2:
        raise ValueError(f"{what} must be a 2-D (rows × K/16) matrix, got shape {tuple(scales.shape)}")


def pad_scales(scales: torch.Tensor) -> torch.Tensor:
    """``scales`` (``rows × scale_cols``, 1-byte dtype) zero-padded at the bottom and the right to
    :func:`padded_shape`; same dtype. The padding is byte 0 (E4M3 +0); see the module docstring
    for why it leaves the product unchanged."""
    _check_matrix(scales, "scales")
    b = _as_bytes(scales, "scales")
    rows, cols = b.shape
    rp, cp = padded_shape(rows, cols)
    out = torch.zeros((rp, cp), dtype=torch.uint8, device=b.device)
    out[:rows, :cols] = b
    return out.view(scales.dtype)


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """The flat (1-D) tiled layout of ``scales`` (``rows × scale_cols``, 1-byte dtype, row-major
    meaning: ``scales[m, j]`` scales elements ``16j…16j+15`` of row ``m``): padded, cut into
    128×4 tiles stored row-major over tiles, each tile stored as in the module docstring.
    Length ``rows_padded · cols_padded``; same dtype as ``scales``."""
    padded = _as_bytes(pad_scales(scales), "scales")
    rp, cp = padded.shape
    # Row r of tile i is 32·q + p (q = r // 32, p = r % 32); column j·4 + c.
    t = padded.reshape(rp // TILE_ROWS, 4, 32, cp // TILE_COLS, TILE_COLS)  # (i, q, p, j, c)
    t = t.permute(0, 3, 2, 1, 4)  # (i, j, p, q, c): offset p·16 + q·4 + c inside tile (i, j)
    return t.contiguous().reshape(-1).view(scales.dtype)


def unswizzle_scales(flat: torch.Tensor, rows: int, scale_cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_scales`: the ``rows × scale_cols`` row-major scales (padding
    dropped) from the flat tiled layout; same dtype as ``flat``."""
    b = _as_bytes(flat, "flat scales")
    if b.dim() != 1:
        raise ValueError(f"flat scales must be 1-D, got shape {tuple(flat.shape)}")
    rp, cp = padded_shape(rows, scale_cols)
    if b.numel() != rp * cp:
        raise ValueError(
            f"flat scales have {b.numel()} elements, but a {rows} × {scale_cols} scale matrix "
            f"in the tiled layout has {rp} × {cp} = {rp * cp} (padded to 128-row × 4-column tiles)"
        )
    t = b.reshape(rp // TILE_ROWS, cp // TILE_COLS, 32, 4, TILE_COLS)  # (i, j, p, q, c)
    t = t.permute(0, 3, 2, 1, 4).reshape(rp, cp)  # (i, q, p, j, c) → rows 128i + 32q + p
    return t[:rows, :scale_cols].contiguous().view(flat.dtype)


@dataclass
class NativeOperands:
    """What a native NVFP4 call for ``A · Bᵀ`` (``A``: ``M × K``, ``B``: ``N × K``) passes.

    Attributes:
        a_data: ``M × K_padded/2`` uint8, two E2M1 codes per byte (element ``2i`` low nibble);
            a native call views it as ``torch.float4_e2m1fn_x2``.
        b_data: ``N × K_padded/2`` uint8, likewise (``B`` row-major over K, i.e. the native
            call's second operand is ``b_data.view(float4_e2m1fn_x2).t()``, column-major).
        a_scale: A's E4M3 block scales in the flat tiled layout (:func:`swizzle_scales`), for an
            ``M × K_padded/16`` matrix.
        b_scale: B's, for ``N × K_padded/16``.
        a_tensor_scale: A's FP32 tensor scale (0-dim).
        b_tensor_scale: B's FP32 tensor scale (0-dim).
        k: the logical reduction length K.
        k_padded: K rounded up to a multiple of 64 (the codes of ``k ≤ i < k_padded`` are 0).
    """

    a_data: torch.Tensor
    b_data: torch.Tensor
    a_scale: torch.Tensor
    b_scale: torch.Tensor
    a_tensor_scale: torch.Tensor
    b_tensor_scale: torch.Tensor
    k: int
    k_padded: int

    @property
    def alpha(self) -> torch.Tensor:
        """``s_tensor(A) · s_tensor(B)`` in FP32: the epilogue factor of a native call."""
        return self.a_tensor_scale.float() * self.b_tensor_scale.float()


def _row_scales(p: PackedNVFP4, what: str) -> torch.Tensor:
    """``p``'s block scales as a ``rows × K/16`` float8_e4m3fn matrix (1×16 groups along K)."""
    if p.scales.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{what}.scales must be torch.float8_e4m3fn, got {p.scales.dtype}")
    rows, k = p.data.shape[0], 2 * p.data.shape[1]
    if p.tile == "16x16":
        # A 16×16 tile scale is the 1×16 scale of each of its 16 rows.
        want = (rows // GROUP, k // GROUP)
        if rows % GROUP or tuple(p.scales.shape) != want:
            raise ValueError(f"{what}: 16x16 scales must have shape {want}, got {tuple(p.scales.shape)}")
        return p.scales.view(torch.uint8).repeat_interleave(GROUP, 0).view(torch.float8_e4m3fn)
    if p.tile != "1x16":
        raise ValueError(f"{what}.tile must be '1x16' or '16x16', got {p.tile!r}")
    if tuple(p.scales.shape) != (rows, k // GROUP):
        raise ValueError(
            f"{what}.scales must have shape (rows, K/16) = {(rows, k // GROUP)} for data of shape "
            f"{tuple(p.data.shape)}, got {tuple(p.scales.shape)}"
        )
    return p.scales


def _check_packed(p: PackedNVFP4, what: str) -> None:
    if not isinstance(p, PackedNVFP4):
        raise ValueError(f"{what} must be a quant.format.PackedNVFP4, got {type(p).__name__}")
    if p.data.dtype != torch.uint8:
        raise ValueError(f"{what}.data must be uint8 (two E2M1 codes per byte), got {p.data.dtype}")
    if p.data.dim() != 2:
        raise ValueError(
            f"{what}.data must be 2-D (rows × K/2, grouped along the reduction dim), got shape "
            f"{tuple(p.data.shape)}"
        )
    k = 2 * p.data.shape[1]
    if k % GROUP:
        raise ValueError(f"{what}: K = {k} is not a multiple of {GROUP} (one E4M3 scale per 16 elements)")
    ts = p.tensor_scale
    if not isinstance(ts, torch.Tensor) or ts.numel() != 1 or ts.dtype != torch.float32:
        raise ValueError(f"{what}.tensor_scale must be a one-element float32 tensor, got {ts!r}")


def native_operands(a: PackedNVFP4, b: PackedNVFP4) -> NativeOperands:
    """The arguments of a native NVFP4 GEMM ``A · Bᵀ`` over the last dim of both operands.

    ``a.data`` (``M × K/2``) and ``b.data`` (``N × K/2``) are passed as they are when K is a
    multiple of 64. Otherwise the scale matrices need a padded column (``K/16`` rounded up to a
    multiple of 4), which stands for elements ``K…K_padded-1``; the data are then padded with
    zero bytes (E2M1 code 0 = +0 in both nibbles) to ``K_padded/2`` bytes per row, so that the
    codes and scales describe the same, zero-extended reduction and the product is unchanged.
    Rows are not padded in the data: only their scales are (the kernel ignores padded rows).
    Raises ``ValueError`` for wrong types, dtypes, shapes or mismatched K / devices.
    """
    _check_packed(a, "a")
    _check_packed(b, "b")
    k = 2 * a.data.shape[1]
    if 2 * b.data.shape[1] != k:
        raise ValueError(
            f"a and b must share the reduction dim K: a.data {tuple(a.data.shape)} is K = {k}, "
            f"b.data {tuple(b.data.shape)} is K = {2 * b.data.shape[1]}"
        )
    if a.data.device != b.data.device:
        raise ValueError(f"a and b are on different devices: {a.data.device} vs {b.data.device}")
    sa, sb = _row_scales(a, "a"), _row_scales(b, "b")
    k_padded = _ceil_to(k, K_ALIGN)
    a_data, b_data = a.data, b.data
    if k_padded != k:
        extra = (k_padded - k) // 2
        a_data = torch.nn.functional.pad(a_data, (0, extra))
        b_data = torch.nn.functional.pad(b_data, (0, extra))
    return NativeOperands(
        a_data=a_data.contiguous(),
        b_data=b_data.contiguous(),
        a_scale=swizzle_scales(sa),
        b_scale=swizzle_scales(sb),
        a_tensor_scale=a.tensor_scale.float().reshape(()),
        b_tensor_scale=b.tensor_scale.float().reshape(()),
        k=k,
        k_padded=k_padded,
    )
