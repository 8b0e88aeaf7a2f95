"""Compile every Triton kernel for a GPU without one (``tests/test_triton_kernels.py``).

    python triton_compile.py        # from tests/, prints {variant: "ok" | why not} as JSON

The interpreter (``triton_kernels.py``) runs the kernels' semantics in numpy; this compiles them
as a GPU run would (to an sm_90 binary, Triton's own ptxas, FMA contraction off), so what only
the compiler rejects is caught on a CPU machine too: an integer argument equal to 1 becomes a
constant, a tensor type the target lacks. One variant per kernel and algorithm.
"""

from __future__ import annotations

import json
import os
import sys

F32, F64, I64, I32, U8 = "*fp32", "*fp64", "*i64", "*i32", "*u8"


def variants():
    from torch_ops.gpu import quant_kernels as Q, select_kernels as S, sketch_kernels as K

    out = []
    for add in (True, False):
        out.append((f"at_least add={add}", S.at_least,
                    {"a_ptr": F32, "g_ptr": F32, "t_ptr": F32, "idx_ptr": I64, "mag_ptr": F32, "count_ptr": I64,
                     "cap": "i32", "n": "i32", "ADD": "constexpr", "BLOCK": "constexpr"}, {"ADD": add, "BLOCK": 1024}))
    out.append(("dgc_update nesterov", S.dgc_update,
                {"g_ptr": F64, "u_ptr": F64, "v_ptr": F64, "m_ptr": F64, "n": "i32", "MOMENTUM": "constexpr",
                 "NESTEROV": "constexpr", "BLOCK": "constexpr"}, {"MOMENTUM": True, "NESTEROV": True, "BLOCK": 1024}))
    for kind, bits in ((0, 1), (1, 1), (2, 1), (3, 2), (4, 5), (4, 8)):
        if kind:
            out.append((f"seg_reduce kind={kind}", Q.seg_reduce,
                        {"x_ptr": F32, "r_ptr": F32, "wstart_ptr": I64, "wlen_ptr": I32, "wseg_ptr": I64,
                         "pstart_ptr": I64, "count_ptr": I64, "part_ptr": F64, "done_ptr": I32, "scales_ptr": F32,
                         "factor_ptr": F32, "levels": "fp32", "KIND": "constexpr", "HAS_R": "constexpr",
                         "CHUNK": "constexpr", "FB": "constexpr"},
                        {"KIND": kind, "HAS_R": True, "CHUNK": 512, "FB": 128}))
        out.append((f"codes kind={kind} bits={bits}", Q.codes,
                    {"x_ptr": F32, "r_ptr": F32, "rout_ptr": F32, "out_ptr": U8, "scales_ptr": F32, "factor_ptr": F32,
                     "moff_ptr": I64, "mfirst_ptr": I64, "mcols_ptr": I64, "nm": "constexpr", "bucket": "i32",
                     "n": "i32",
                     "nbytes": "i32",
                     "base": "constexpr", "levels": "fp32", "inv_levels": "fp32", "KIND": "constexpr",
                     "BITS": "constexpr", "HAS_R": "constexpr", "WRITE_R": "constexpr", "LOG": "constexpr",
                     "BUCKETED": "constexpr", "COLUMNS": "constexpr", "BLOCK": "constexpr"},
                    {"nm": 1, "base": 1, "KIND": kind, "BITS": bits, "HAS_R": True, "WRITE_R": kind != 0, "LOG": 2,
                     "BUCKETED": kind != 2, "COLUMNS": kind == 2, "BLOCK": 1024}))
        out.append((f"decode_sum kind={kind} bits={bits}", Q.decode_sum,
                    {"buf_ptr": U8, "out_ptr": F32, "moff_ptr": I64, "mfirst_ptr": I64, "mcols_ptr": I64, "nm": "i32",
                     "bucket": "constexpr", "n": "i32", "part": "i32", "head": "i32",
                     "world": "constexpr",
                     "levels": "fp32", "inv_levels": "fp32", "mult": "fp32", "KIND": "constexpr", "BITS": "constexpr",
                     "SCALE": "constexpr", "LOG": "constexpr", "BUCKETED": "constexpr", "COLUMNS": "constexpr",
                     "BLOCK": "constexpr"},
                    {"bucket": 1, "world": 1, "KIND": kind, "BITS": bits, "SCALE": True, "LOG": 0, "BUCKETED": False,
                     "COLUMNS": kind == 2, "BLOCK": 1024}))
    out.append(("col_reduce", Q.col_reduce,
                {"x_ptr": F32, "r_ptr": F32, "woff_ptr": I64, "wcols_ptr": I64, "wcol0_ptr": I64, "wrow0_ptr": I64,
                 "wrlen_ptr": I64, "wcb_ptr": I64, "cbw_ptr": I64, "cbcol_ptr": I64, "cbrows_ptr": I64,
                 "part_ptr": F64, "done_ptr": I32, "scales_ptr": F32, "HAS_R": "constexpr", "RB": "constexpr",
                 "CB": "constexpr"}, {"HAS_R": True, "RB": 128, "CB": 32}))
    out.append(("sample_abs", S.sample_abs,
                {"a_ptr": F32, "g_ptr": F32, "out_ptr": F32, "count_ptr": I64, "start": "i32", "stride": "i32",
                 "m": "i32", "ADD": "constexpr", "BLOCK": "constexpr"}, {"ADD": True, "BLOCK": 1024}))
    out.append(("at_least_keys", S.at_least_keys,
                {"a_ptr": F32, "g_ptr": F32, "tv_ptr": F32, "nt": "i32", "lower": "fp32", "times": "i32",
                 "keys_ptr": I64, "count_ptr": I64,
                 "cap": "i32", "n": "i32", "ADD": "constexpr", "BLOCK": "constexpr", "TB": "constexpr"},
                {"ADD": True, "BLOCK": 1024, "TB": 64}))
    for wire in (True, False):
        out.append((f"take_zero wire={wire}", S.take_zero,
                    {"idx_ptr": I64, "v_ptr": F32, "u_ptr": F32, "wire_ptr": "*i32" if wire else F32, "vals_ptr": F32,
                     "k": "i32", "HAS_U": "constexpr", "WIRE": "constexpr", "BLOCK": "constexpr"},
                    {"HAS_U": not wire, "WIRE": wire, "BLOCK": 1024}))
    out.append(("update_sketch R=8", K.update_sketch,
                {"g_ptr": F32, "u_ptr": F32, "v_ptr": F32, "m_ptr": F32, "cells_ptr": F32, "low_ptr": I64,
                 "high_ptr": I64, "n": "i32", "r": "i32", "n_low": "i32", "n_high": "constexpr", "cols2": "i32",
                 "R": "constexpr", "BLOCK": "constexpr"}, {"n_high": 1, "R": 8, "BLOCK": 512}))
    out.append(("estimates R=8", K.estimates,
                {"table_ptr": F32, "out_ptr": F32, "low_ptr": I64, "high_ptr": I64, "n": "i32", "r": "i32",
                 "n_low": "i32", "n_high": "i32", "cols2": "i32", "R": "constexpr", "BLOCK": "constexpr"},
                {"R": 8, "BLOCK": 128}))
    return out


def main() -> None:
    os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not interpreted ones
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    out = {}
    for name, fn, sig, consts in variants():
        try:
            triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=target,
                           options={"enable_fp_fusion": False})
            out[name] = "ok"
        except Exception as e:  # reported per variant
            out[name] = f"{type(e).__name__}: {str(e)[:2000]}"
    print("RESULTS " + json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
