"""The XLA route's readers (CPU): Riegeli records and kernel launches of two executables serialized
on the H200 (tests/data/), and hand-built Riegeli files, ELF images, PTX and Triton pass logs.
"""

from __future__ import annotations

import struct

import pytest

from funcmla.interop import _containers, _xla_kernels
from funcmla.interop import launcher as L
from tests.launcher_helpers import PTX, SCALE, _lowering_available, _varint


# ----------------------------------------------------------------------------- XLA route readers
def _cuda_elf(symbol: bytes, payload: bytes = b"\xAA" * 40) -> bytes:
    """A minimal EM_CUDA ELF: header, one PROGBITS section (payload), a strtab, section table."""
    strtab = b"\0" + symbol + b"\0"
    body = payload + strtab
    shoff = 64 + len(body)
    hdr = bytearray(64)
    hdr[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<HHI", hdr, 16, 2, 190, 1)
    struct.pack_into("<QQ", hdr, 32, 0, shoff)
    struct.pack_into("<HHHH", hdr, 54, 56, 0, 64, 3)
    sections = bytes(64)  # null section
    for typ, off, size in ((1, 64, len(payload)), (3, 64 + len(payload), len(strtab))):
        sh = bytearray(64)
        struct.pack_into("<I", sh, 4, typ)
        struct.pack_into("<QQ", sh, 24, off, size)
        sections += bytes(sh)
    return bytes(hdr) + body + sections


def test_elf_images_are_cut_out_of_a_blob():
    a, b = _cuda_elf(b"mla_decode_ps1_m16_kv64"), _cuda_elf(b"funcmla_merge_s4_d512")
    x86 = bytearray(_cuda_elf(b"other"))
    struct.pack_into("<H", x86, 18, 62)  # EM_X86_64: not a cubin
    blob = b"pickle\x00head" + a + b"\x12proto" + bytes(x86) + b + b"tail\x7fELF"
    assert _xla_kernels.elf_images(blob) == [a, b]
    assert _xla_kernels.elf_images(a[:-10]) == []  # truncated: not taken


def _cubin_with_info(kernels: dict) -> bytes:
    """A minimal cubin with `.text.<k>` and `.nv.info.<k>` sections: kernels maps a name to
    (parameter sizes in bytes, block or None), written as EIATTR_KPARAM_INFO records (size in
    the top 14 bits), EIATTR_CBANK_PARAM_SIZE and EIATTR_MAX_THREADS."""
    names, bodies = [""], [b""]
    for name, (sizes, block) in kernels.items():
        info = b""
        for i, size in enumerate(sizes):
            info += bytes([0x04, 0x17]) + struct.pack("<HIHHI", 12, 0, i, 8 * i,
                                                      (size << 18) | 0x1F000)
        info += bytes([0x03, 0x19]) + struct.pack("<H", sum(sizes))
        if block:
            info += bytes([0x04, 0x05]) + struct.pack("<HIII", 12, *block)
        names += [".text." + name, ".nv.info." + name]
        bodies += [b"\0" * 16, info]
    names.append(".shstrtab")
    strtab = b"".join(n.encode() + b"\0" for n in names)
    bodies.append(strtab)
    name_offs = [strtab.index(n.encode() + b"\0") if n else 0 for n in names]
    data, offs = b"", []
    for body in bodies:
        offs.append(64 + len(data))
        data += body
    hdr = bytearray(64)
    hdr[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<HH", hdr, 16, 2, 190)
    struct.pack_into("<Q", hdr, 0x28, 64 + len(data))
    struct.pack_into("<HHH", hdr, 0x3A, 64, len(names), len(names) - 1)
    table = b"".join(struct.pack("<IIQQQQIIQQ", name_offs[i], 3 if n == ".shstrtab" else
                                 (0 if i == 0 else 1), 0, 0, offs[i], len(bodies[i]), 0, 0, 1, 0)
                     for i, n in enumerate(names))
    return bytes(hdr) + data + table


def test_cubin_entries_read_symbols_and_parameters_from_the_sections():
    img = _cubin_with_info({"mla_decode_ps1_m16_kv64": ([8] * 6, (128, 1, 1)),
                            "funcmla_merge_s4_d64": ([8] * 4, None),
                            "odd": ([8, 4], None)})
    got = _xla_kernels.cubin_entries(img)
    assert sorted(got) == ["funcmla_merge_s4_d64", "mla_decode_ps1_m16_kv64", "odd"]
    params, block = got["mla_decode_ps1_m16_kv64"]
    assert len(params) == 6 and all(".u64" in p for p in params) and block == (128, 1, 1)
    assert got["funcmla_merge_s4_d64"] == ([f".param .u64 p{i}" for i in range(4)], None)
    assert got["odd"][0] == [".param .u64 p0", ".param .b8 p1[4]"]
    assert _xla_kernels.elf_images(b"hdr" + img + b"tail") == [img]


def _snappy_literal_block(data: bytes) -> bytes:
    """`data` as a valid Snappy block of literals only (60 = one extra length byte)."""
    out, n = bytearray(), len(data)
    while True:  # preamble: uncompressed length, little-endian base-128
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            break
    for i in range(0, len(data), 256):
        chunk = data[i:i + 256]
        out += bytes([60 << 2, len(chunk) - 1]) + chunk
    return bytes(out)


def test_snappy_blocks_decode_with_literals_and_overlapping_copies():
    # "abcd" literal, then a 1-byte-offset copy of 8 from 4 back (overlaps its own output)
    assert _containers.snappy_decompress(b"\x0c\x0cabcd\x11\x04") == b"abcd" * 3
    # 2-byte-offset copy (kind 2) of 3 bytes from 2 back
    assert _containers.snappy_decompress(b"\x05\x04xy\x0a\x02\x00") == b"xyxyx"
    for bad in (b"\x08\x0cabcd\x01\x09",   # offset past the output
                b"\x08\x0cab",               # truncated literal
                b"\x05\x0cabcd"):            # longer than announced
        with pytest.raises(ValueError):
            _containers.snappy_decompress(bad)
    block = _snappy_literal_block(b"0123456789" * 30)  # 300 bytes: several literal runs
    assert _containers.snappy_decompress(block) == b"0123456789" * 30


_RIEGELI_START = bytes.fromhex(
    "83af70d10d884a3f00000000000000004000000000000000"
    "91bac23c9287e1a90000000000000000e19f13c0e9b1c372"
    "73000000000000000000000000000000")


def _riegeli_file(chunks: list[tuple[list[bytes], str]], *, kind: int = 0x72) -> bytes:
    """A Riegeli file of simple chunks, each (records, compression "" or "s"), hashes zero, with
    a 24-byte block header at every 64 KiB boundary (as Riegeli writes them)."""
    logical = bytearray(_RIEGELI_START[24:])  # the signature chunk
    for records, compression in chunks:
        sizes = b"".join(_varint(len(r)) for r in records)
        values = b"".join(records)
        if compression == "s":
            sizes = _varint(len(sizes)) + _snappy_literal_block(sizes)
            values = _varint(len(values)) + _snappy_literal_block(values)
        data = bytes([0x73 if compression == "s" else 0]) + _varint(len(sizes)) + sizes + values
        logical += struct.pack("<5Q", 0, len(data), 0, kind | len(records) << 8,
                               sum(map(len, records))) + data
    out, pos = bytearray(), 0
    while pos < len(logical):
        out += _RIEGELI_START[:24] if not out else bytes(24)  # block header
        out += logical[pos:pos + 65536 - 24]
        pos += 65536 - 24
    return bytes(out)


def test_riegeli_records_read_simple_chunks_across_block_boundaries():
    big = bytes(range(256)) * 300  # 76800 bytes: the file spans two 64 KiB blocks
    f = _riegeli_file([([b"meta", b"", b"x" * 200], "s"), ([big, b"tail"], "")])
    assert len(f) > 65536
    assert _containers.riegeli_records(f) == [b"meta", b"", b"x" * 200, big, b"tail"]
    inner = _riegeli_file([([b"gpu-executable-proto"], "s")])
    outer = b"\x05header" + _riegeli_file([([b"type", inner, b"options"], "s")])
    assert _xla_kernels.executable_records(outer) == [b"type", b"gpu-executable-proto",
                                                      b"options"]
    assert _xla_kernels.executable_records(b"no riegeli") == []
    # a file inside a longer blob (jax's pickle): reading stops where the file ends
    assert _xla_kernels.executable_records(b"head" + inner + b"\x94\x8c\x05trail") == \
        [b"gpu-executable-proto"]
    with pytest.raises(ValueError, match="not a Riegeli file"):
        _containers.riegeli_records(b"x" + f)
    with pytest.raises(ValueError, match="truncated"):
        _containers.riegeli_records(f[:-10])
    with pytest.raises(ValueError, match="type 't'"):  # transposed chunks are not read
        _containers.riegeli_records(_riegeli_file([([b"r"], "")], kind=0x74))
    zstd = bytearray(_riegeli_file([([b"abc"], "")]))
    zstd[64 + 40] = 0x7A  # compression byte of the chunk: 'z'
    with pytest.raises(ValueError, match="compressed with 'z'"):
        _containers.riegeli_records(bytes(zstd))
    lying = bytearray(_riegeli_file([([b"abc", b"de"], "")]))
    lying[64 + 25] = 3  # the header announces 3 records; the sizes list holds 2
    with pytest.raises(ValueError, match="2 record sizes"):
        _containers.riegeli_records(bytes(lying))


# Serialized executables captured on the H200 (jax/jaxlib 0.11.2, CUDA 13, 2026-11-30):
# `compiled.runtime_executable().serialize()` of (a) a one-kernel Pallas probe (128 floats,
# x * 2 + 1, 4 warps) and (b) mla_decode for B=32, H=16, 1024-token CSR, 4 splits (decode +
# merge). The grid, block and shared memory below are what CUPTI recorded XLA launching
# (cuLaunchKernelEx) in the same run; launching these cubins from the launcher gave outputs
# bit-identical to the executable's.
_DATA = __import__("pathlib").Path(__file__).parent / "data"


def test_launch_specs_of_real_jaxlib_0112_executables():
    probe = (_DATA / "xla_executable_probe_jaxlib0112.bin").read_bytes()
    [k] = _xla_kernels.executable_launches(probe)
    assert (k.entry, k.grid, k.block, k.shared_mem_bytes) == ("probe_kernel", (1, 1, 1),
                                                              (128, 1, 1), 0)
    assert _xla_kernels.cubin_entries(k.image)["probe_kernel"][0] == \
        [".param .u64 p0", ".param .u64 p1"]
    split = (_DATA / "xla_executable_decode_split_jaxlib0112.bin").read_bytes()
    got = {k.entry: k for k in _xla_kernels.executable_launches(split)}
    dec, mer = got["mla_decode_ps1_m16_kv64"], got["funcmla_merge_s4_d64"]
    assert (dec.grid, dec.block, dec.shared_mem_bytes) == ((1, 4, 32), (128, 1, 1), 168960)
    assert (mer.grid, mer.block, mer.shared_mem_bytes) == ((32, 1, 8), (128, 1, 1), 0)
    assert dec.image[:4] == mer.image[:4] == b"\x7fELF" and dec.image != mer.image
    assert _xla_kernels.elf_images(dec.image) == [dec.image]  # a whole image, cut exactly
    assert list(_xla_kernels.cubin_entries(dec.image)) == ["mla_decode_ps1_m16_kv64"]
    assert len(_xla_kernels.cubin_entries(mer.image)["funcmla_merge_s4_d64"][0]) == 4
    # jax's pickle around the same bytes reads the same
    wrapped = b"\x80\x05\x95" + split + b"\x94\x85\x94."
    assert [k.entry for k in _xla_kernels.executable_launches(wrapped)] == list(got)


def test_xla_route_takes_kernels_from_the_executables_launches(monkeypatch):
    split = (_DATA / "xla_executable_decode_split_jaxlib0112.bin").read_bytes()
    monkeypatch.setattr(_xla_kernels, "_compile", lambda fn, avals: object())
    monkeypatch.setattr(_xla_kernels, "_serialized_executable", lambda c: split)

    def no_dump(*a):
        raise AssertionError("the dump route must not run when the executable has launches")

    monkeypatch.setattr(_xla_kernels, "_compile_with_dump", no_dump)
    wants = {"mla_decode_ps1_m16_kv64": (6, 128, (1, 4, 32)),
             "funcmla_merge_s4_d64": (4, 128, (32, 1, 8))}
    got = _xla_kernels.xla_kernels(None, (), wants, None)
    dec, mer = got["mla_decode_ps1_m16_kv64"], got["funcmla_merge_s4_d64"]
    assert (dec.entry, dec.num_params, dec.shared_mem_bytes, dec.grid) == (
        "mla_decode_ps1_m16_kv64", 6, 168960, (1, 4, 32))
    assert (mer.num_params, mer.shared_mem_bytes, mer.block) == (4, 0, (128, 1, 1))
    assert "kernel launch" in dec.image_from and "kernel launch" in dec.shared_mem_from
    # unnamed kernel: the one launch with its signature
    other = _xla_kernels.xla_kernels(None, (), {"other": (4, 128, (32, 1, 8))}, None)["other"]
    assert other.entry == "funcmla_merge_s4_d64" and "by signature" in other.image_from
    with pytest.raises(RuntimeError, match="no kernel named 'other'"):  # grid differs
        _xla_kernels.xla_kernels(None, (), {"other": (4, 128, (32, 2, 8))}, None)
    with pytest.raises(RuntimeError, match="grid"):  # named, but XLA launches another grid
        _xla_kernels.xla_kernels(None, (), {"mla_decode_ps1_m16_kv64": (6, 128, (1, 2, 32))},
                                 None)
    with pytest.raises(RuntimeError, match="expected 5 64-bit pointers"):
        _xla_kernels.xla_kernels(None, (), {"mla_decode_ps1_m16_kv64": 5}, None)
    with pytest.raises(RuntimeError, match="block 256"):
        _xla_kernels.xla_kernels(None, (), {"funcmla_merge_s4_d64": (4, 256)}, None)


def test_pass_log_takes_the_last_shared_allocation(tmp_path):
    log = tmp_path / "m.k.triton-passes.log"
    log.write_text('// -----// IR Dump\nmodule attributes {"ttg.num-warps" = 4 : i32} {}\n'
                   'module attributes {ttg.shared = 1024 : i32, "ttg.num-warps" = 4 : i32}\n'
                   'module attributes {ttg.shared = 94720 : i32, ttg.target = "cuda:90"}\n')
    assert _xla_kernels.pass_log_shared_bytes(str(log)) == 94720
    log.write_text("module {}\n")
    assert _xla_kernels.pass_log_shared_bytes(str(log)) is None


def test_ptx_is_found_inside_a_serialized_executable():
    text = "//\n// Generated by LLVM NVPTX Back-End\n//\n" + PTX.strip()
    blob = b"\x08\x01\x1a\x99" + text.encode() + b"\x00\x22\x7fELF binary"
    got = _xla_kernels.ptx_from_blob(blob, "mla_decode_ps1")
    assert list(got) == ["mla_decode_ps1_m16_kv64"]
    module, params = got["mla_decode_ps1_m16_kv64"]
    assert module == text and len(params) == 3
    assert _xla_kernels.ptx_from_blob(blob, "funcmla_merge") == {}


def test_ptx_block_reads_the_declared_block():
    assert _xla_kernels.ptx_block(PTX, "mla_decode_ps1_m16_kv64") == (128, 1, 1)
    assert _xla_kernels.ptx_block(PTX.replace(".reqntid 128", ".maxntid 256, 1, 1"),
                                  "mla_decode_ps1_m16_kv64") == (256, 1, 1)
    assert _xla_kernels.ptx_block(PTX.replace(".reqntid 128\n", ""),
                                  "mla_decode_ps1_m16_kv64") is None


def test_ptx_entries_lists_every_kernel():
    two = PTX + PTX.replace("mla_decode_ps1_m16_kv64", "funcmla_merge_s2_d512")
    got = _xla_kernels.ptx_entries(two)
    assert sorted(got) == ["funcmla_merge_s2_d512", "mla_decode_ps1_m16_kv64"]
    assert all(len(p) == 3 for p in got.values())


def _fake_xla(monkeypatch, tmp_path, *, blob, log_shared, dump_ptx=True):
    """Stand in for XLA's compile: write the files XLA would dump into the dump directory."""
    two = PTX + PTX.replace("mla_decode_ps1_m16_kv64", "funcmla_merge_s2_d512_1").replace(
        "_param_2\n", "_param_2,\n\t.param .u64 .ptr .global .align 1 x_param_3\n")

    def compile_with_dump(fn, avals, dump_dir):
        if dump_ptx:
            with open(f"{dump_dir}/module_0001.jit_csr.sm_9.0_gpu_after_optimizations.ptx",
                      "w") as f:
                f.write(two)
        if log_shared is not None:
            with open(f"{dump_dir}/module_0001.jit_csr.mla_decode_ps1_m16_kv64."
                      "triton-passes.log", "w") as f:
                f.write(f"module attributes {{ttg.shared = 1024 : i32}}\n"
                        f"module attributes {{ttg.shared = {log_shared} : i32}}\n")
        return object(), {"xla_dump_emitter_re": "triton-fusion"}, []

    monkeypatch.setattr(_xla_kernels, "_compile", lambda fn, avals: object())
    monkeypatch.setattr(_xla_kernels, "_compile_with_dump", compile_with_dump)
    monkeypatch.setattr(_xla_kernels, "_serialized_executable", lambda c: blob)
    return two


def test_xla_route_takes_xlas_cubin_symbol_params_and_shared_memory(monkeypatch, tmp_path):
    cubin = _cuda_elf(b"mla_decode_ps1_m16_kv64")
    _fake_xla(monkeypatch, tmp_path, blob=b"pickle" + cubin + b"rest", log_shared=94720)
    ptxas = []
    got = _xla_kernels.xla_kernels(None, (), {"mla_decode_ps1_m16_kv64": 3,
                                              "funcmla_merge_s2_d512": 4},
                                   lambda ptx: ptxas.append(ptx) or (b"IMG", "ptxas:x"))
    dec, mer = got["mla_decode_ps1_m16_kv64"], got["funcmla_merge_s2_d512"]
    assert (dec.entry, dec.num_params, dec.shared_mem_bytes) == ("mla_decode_ps1_m16_kv64", 3,
                                                                 94720)
    assert dec.image == cubin and "serialized executable" in dec.image_from
    assert "pass log" in dec.shared_mem_from
    # the merge: XLA uniquified its name; no cubin defines it -> ptxas on XLA's PTX; no log
    assert mer.entry == "funcmla_merge_s2_d512_1" and mer.num_params == 4
    assert mer.image == b"IMG" and mer.shared_mem_bytes is None and len(ptxas) == 1
    with pytest.raises(RuntimeError, match="expected 5 64-bit pointers"):
        _xla_kernels.xla_kernels(None, (), {"mla_decode_ps1_m16_kv64": 5}, None)
    # a kernel XLA did not name after the Pallas call: the one entry with its signature
    other = _xla_kernels.xla_kernels(None, (), {"other": (3, 128)}, None)["other"]
    assert other.entry == "mla_decode_ps1_m16_kv64" and "by signature" in other.image_from
    with pytest.raises(RuntimeError, match="no kernel named 'other'"):  # block differs
        _xla_kernels.xla_kernels(None, (), {"other": (3, 256)}, None)
    with pytest.raises(RuntimeError, match="no kernel named 'y'"):  # the only one is taken
        _xla_kernels.xla_kernels(None, (), {"x": (3, None), "y": (3, None)}, None)
    with pytest.raises(RuntimeError, match="128"):  # named, but launched with another block
        _xla_kernels.xla_kernels(None, (), {"mla_decode_ps1_m16_kv64": (3, 64)}, None)


def test_xla_route_reads_ptx_from_the_executable_when_none_is_dumped(monkeypatch, tmp_path):
    text = "//\n// Generated by LLVM NVPTX Back-End\n//\n" + PTX.strip()
    cubin = _cuda_elf(b"mla_decode_ps1_m16_kv64")
    _fake_xla(monkeypatch, tmp_path, blob=b"\x01" + text.encode() + b"\x00" + cubin,
              log_shared=None, dump_ptx=False)
    got = _xla_kernels.xla_kernels(None, (), {"mla_decode_ps1_m16_kv64": 3}, None)
    k = got["mla_decode_ps1_m16_kv64"]
    assert k.ptx == text and k.image == cubin and k.shared_mem_bytes is None


def test_compile_plan_falls_back_to_triton_when_the_xla_route_fails(monkeypatch):
    cfg = L.DecodeLaunchConfig(num_seqs=2, num_heads=16, pool_rows=64, kv_capacity=32,
                               num_splits=2, sm_scale=SCALE)
    if _lowering_available() is not None:
        pytest.skip("no lowering")
    plan = L.decode_plan(cfg)

    def boom(p):
        raise RuntimeError("no dump")

    monkeypatch.setattr(L.compile, "_xla_images", boom)
    monkeypatch.setattr(L.compile, "kernel_route", lambda route=None: "xla")
    monkeypatch.delenv("FUNCMLA_LAUNCHER_COMPILER", raising=False)
    fake = L.CompiledImage(b"x", "k", 9, 0, "triton 3.6", "", "triton")
    monkeypatch.setattr(L.compile, "_compile_cached", lambda call, arch: fake)
    L.compile._compile_plan.cache_clear()
    with pytest.warns(RuntimeWarning, match="not bit-identical"):
        images = L.compile_plan(plan, "9.0")
    assert all("XLA route failed: RuntimeError: no dump" in im.how for im in images.values())
    assert {im.route for im in images.values()} == {"triton"}
    L.compile._compile_plan.cache_clear()
    with pytest.raises(L.LauncherUnavailable, match="XLA route failed"):
        L.compile_plan(plan, "9.0", "xla")
    # the environment is read per call, not frozen into the cache by the first one
    with pytest.warns(RuntimeWarning, match="not bit-identical"):
        L.compile_plan(plan, "9.0")
    monkeypatch.setenv("FUNCMLA_LAUNCHER_COMPILER", "xla")
    with pytest.raises(L.LauncherUnavailable, match="XLA route failed"):
        L.compile_plan(plan, "9.0")
    L.compile._compile_plan.cache_clear()


