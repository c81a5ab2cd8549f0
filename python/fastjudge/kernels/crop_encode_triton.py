"""The fused crop encoder's Triton kernel (the launcher and the torch reference of the same
preprocessing: ``crop_encode.py``). Imported on first use: importing it imports Triton."""

import triton
import triton.language as tl


@triton.jit
def aa_weight(pos, center, inv_scale, CUBIC: tl.constexpr):
    """ATen's antialias filter at source pixel ``pos``: Keys cubic (a = -0.5) or triangle."""
    t = tl.abs((pos.to(tl.float32) - center + 0.5) * inv_scale)
    if CUBIC:  # FMA-contracted like ATen's compiled cubic_convolution1/2: bit-identical weights
        return tl.where(t < 1.0, tl.fma(tl.fma(t, 1.5, -2.5) * t, t, 1.0),
                        tl.where(t < 2.0, tl.fma(tl.fma(tl.fma(t, -0.5, 2.5), t, -4.0), t, 2.0), 0.0))
    else:
        return tl.maximum(1.0 - t, 0.0)


@triton.jit
def crop_encode_kernel(img_ptr, table_ptr, scales_ptr, patch_box_ptr, mean_ptr, std_ptr, out_ptr, n_rows,
                       P: tl.constexpr, M: tl.constexpr, T: tl.constexpr, C: tl.constexpr,
                       ROWS: tl.constexpr, BLOCK_E: tl.constexpr, NCOLS: tl.constexpr, CUBIC: tl.constexpr,
                       QUANTIZE: tl.constexpr):
    """ROWS output patch rows per program ([ROWS, C*p*p] resampled values), each stored T times.
    Every row carries its own box parameters, so one program may span boxes."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    box = tl.load(patch_box_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    tb = table_ptr + box * NCOLS
    base = tl.load(tb + 0)[:, None]
    sc = tl.load(tb + 1)[:, None]
    sh = tl.load(tb + 2)[:, None]
    sw = tl.load(tb + 3)[:, None]
    y0 = tl.load(tb + 4)[:, None]
    x0 = tl.load(tb + 5)[:, None]
    crop_h = tl.load(tb + 6).to(tl.int32)[:, None]
    crop_w = tl.load(tb + 7).to(tl.int32)[:, None]
    grid_w = tl.load(tb + 8).to(tl.int32)
    local = rows - tl.load(tb + 9).to(tl.int32)
    taps_y = tl.load(tb + 10).to(tl.int32)
    taps_x = tl.load(tb + 11).to(tl.int32)
    y_first = tl.load(tb + 12) != 0  # Pillow's pass order for this box (uint8 "pil" mode)
    fb = scales_ptr + box * 6  # float32: scale, support, 1/scale (1 when upscaling), per axis
    scale_h = tl.load(fb + 0)[:, None]
    scale_w = tl.load(fb + 1)[:, None]
    support_h = tl.load(fb + 2)[:, None]
    support_w = tl.load(fb + 3)[:, None]
    inv_h = tl.load(fb + 4)[:, None]
    inv_w = tl.load(fb + 5)[:, None]

    # which patch: merge blocks row-major over the grid, patches row-major inside a block
    blocks_w = grid_w // M
    blk = local // (M * M)
    within = local % (M * M)
    gy = ((blk // blocks_w) * M + within // M)[:, None]
    gx = ((blk % blocks_w) * M + within % M)[:, None]

    e = tl.arange(0, BLOCK_E)[None, :]
    mask = row_ok[:, None] & (e < C * P * P)
    c = e // (P * P)
    oy = gy * P + (e // P) % P  # [ROWS, BLOCK_E] pixel of the resized crop
    ox = gx * P + e % P

    # ATen's _compute_indices_min_size_weights_aa: centre, first tap, tap count, normalized weights
    center_y = scale_h * (oy.to(tl.float32) + 0.5)
    center_x = scale_w * (ox.to(tl.float32) + 0.5)
    ymin = tl.maximum((center_y - support_h + 0.5).to(tl.int32), 0)
    xmin = tl.maximum((center_x - support_w + 0.5).to(tl.int32), 0)
    ysize = tl.minimum(tl.minimum((center_y + support_h + 0.5).to(tl.int32), crop_h) - ymin, taps_y[:, None])
    xsize = tl.minimum(tl.minimum((center_x + support_w + 0.5).to(tl.int32), crop_w) - xmin, taps_x[:, None])
    ny = tl.max(tl.where(row_ok, taps_y, 0), axis=0)
    nx = tl.max(tl.where(row_ok, taps_x, 0), axis=0)
    total_y = tl.zeros([ROWS, BLOCK_E], dtype=tl.float32)
    for j in range(0, ny):
        total_y += tl.where(j < ysize, aa_weight(ymin + j, center_y, inv_h, CUBIC), 0.0)
    total_x = tl.zeros([ROWS, BLOCK_E], dtype=tl.float32)
    for i in range(0, nx):
        total_x += tl.where(i < xsize, aa_weight(xmin + i, center_x, inv_w, CUBIC), 0.0)
    total_y = tl.where(total_y != 0.0, total_y, 1.0)
    total_x = tl.where(total_x != 0.0, total_x, 1.0)

    # The first pass along one axis for each tap of the other, then their combination: width
    # pass per source row then the vertical combination (ATen's order), or, for boxes Pillow
    # resizes height first, height pass per source column then the horizontal combination.
    src = img_ptr + base + c.to(tl.int64) * sc
    yf = y_first[:, None]
    n_outer = tl.max(tl.where(row_ok, tl.where(y_first, taps_x, taps_y), 0), axis=0)
    n_inner = tl.max(tl.where(row_ok, tl.where(y_first, taps_y, taps_x), 0), axis=0)
    acc = tl.zeros([ROWS, BLOCK_E], dtype=tl.float32)
    for a in range(0, n_outer):
        ya = ymin + a
        xa = xmin + a
        outer_ok = mask & tl.where(yf, a < xsize, a < ysize)
        racc = tl.zeros([ROWS, BLOCK_E], dtype=tl.float32)
        for b in range(0, n_inner):
            yj = tl.where(yf, ymin + b, ya)
            xi = tl.where(yf, xa, xmin + b)
            ok = outer_ok & tl.where(yf, b < ysize, b < xsize)
            v = tl.load(src + (y0 + yj.to(tl.int64)) * sh + (x0 + xi.to(tl.int64)) * sw, mask=ok,
                        other=0).to(tl.float32)
            w_in = tl.where(yf, aa_weight(yj, center_y, inv_h, CUBIC) / total_y,
                            aa_weight(xi, center_x, inv_w, CUBIC) / total_x)
            racc = tl.fma(v, tl.where(ok, w_in, 0.0), racc)  # ATen's CPU loops compile to FMAs
        if QUANTIZE == 2:  # PIL: the intermediate image is uint8 (clip, round half up)
            racc = tl.floor(tl.minimum(tl.maximum(racc, 0.0), 255.0) + 0.5)
        w_out = tl.where(yf, aa_weight(xa, center_x, inv_w, CUBIC) / total_x,
                         aa_weight(ya, center_y, inv_h, CUBIC) / total_y)
        acc = tl.fma(racc, tl.where(outer_ok, w_out, 0.0), acc)

    if QUANTIZE == 2:
        acc = tl.floor(tl.minimum(tl.maximum(acc, 0.0), 255.0) + 0.5)
    elif QUANTIZE == 1:  # torchvision: clamp, round half to even
        acc = tl.minimum(tl.maximum(acc, 0.0), 255.0)
        r = tl.floor(acc + 0.5)
        odd = (r.to(tl.int32) % 2) == 1
        acc = tl.where(((r - acc) == 0.5) & odd, r - 1.0, r)
    mean = tl.load(mean_ptr + c, mask=mask, other=0.0)
    std = tl.load(std_ptr + c, mask=mask, other=1.0)
    val = (acc - mean) / std
    out_row = out_ptr + rows.to(tl.int64)[:, None] * (C * T * P * P) + c * (T * P * P) + e % (P * P)
    for k in range(T):
        tl.store(out_row + k * (P * P), val, mask=mask)
