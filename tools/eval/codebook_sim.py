#!/usr/bin/env python3
"""Mean squared error of 2-bit codes for one key channel over a run of rows, on Gaussian runs
(what Hadamard-rotated keys approach): the uniform codes of group_quant.h (min-max range, with
and without its clip search over kClipAlphaGrid), 3-bit uniform codes for scale, and a fixed
non-uniform 4-level codebook (Lloyd-Max for a unit Gaussian: +-0.4528, +-1.510, scaled by the
run's std around its mean). docs/RESULTS.md, "Mixed key precision by layer", quotes its output.

  codebook_sim.py [--rows 32] [--runs 200000] [--seed 0]
"""
import argparse

import numpy as np

ALPHAS = (1.0, 0.97, 0.94, 0.90, 0.85)  # kClipAlphaGrid (include/veloxquant/group_quant.h)
LLOYD_MAX_4 = np.array([-1.510, -0.4528, 0.4528, 1.510])  # unit Gaussian, 4 levels


def uniform_mse(x, levels, alphas):
    """Per run: the least mean squared error over the alphas (group_quant.h's search)."""
    lo, hi = x.min(1, keepdims=True), x.max(1, keepdims=True)
    mid, rng = (lo + hi) / 2, hi - lo
    best = None
    for a in alphas:
        low, scale = mid - a * rng / 2, a * rng / levels
        code = np.clip(np.rint((x - low) / scale), 0, levels)
        err = ((code * scale + low - x) ** 2).mean(1)
        best = err if best is None else np.minimum(best, err)
    return best.mean()


def lloyd_max_mse(x):
    mean, std = x.mean(1, keepdims=True), x.std(1, keepdims=True)
    z = (x - mean) / std
    code = np.abs(z[..., None] - LLOYD_MAX_4).argmin(-1)
    return (((LLOYD_MAX_4[code] * std + mean) - x) ** 2).mean()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--runs", type=int, default=200000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    x = np.random.default_rng(a.seed).standard_normal((a.runs, a.rows))
    print(f"2-bit uniform, no clip search : {uniform_mse(x, 3, (1.0,)):.4f}")
    print(f"2-bit uniform, clip search    : {uniform_mse(x, 3, ALPHAS):.4f}")
    print(f"2-bit Lloyd-Max (mean, std)   : {lloyd_max_mse(x):.4f}")
    print(f"3-bit uniform, clip search    : {uniform_mse(x, 7, ALPHAS):.4f}")


if __name__ == "__main__":
    main()
