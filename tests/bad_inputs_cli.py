"""Bad arguments to the `funcmla` command, in-process through `funcmla.cli.run` (the console
script `funcmla.cli.main` prints the CLIError as `funcmla: error: ...` and exits with status 2;
tests/test_cli.py checks that end to end)."""

from __future__ import annotations

import json
import os
import tempfile

from funcmla.cli import CLIError, run
from tests.bad_input import BadInput

LIMIT = r"2147483647"


def cli(*argv):
    return lambda: run(list(argv))


def batch_file(content) -> str:
    fd, path = tempfile.mkstemp(suffix=".json")
    with os.fdopen(fd, "w") as f:
        f.write(content if isinstance(content, str) else json.dumps(content))
    return path


def with_batch(content, kind="decode"):
    return lambda: run(["plan", kind, "--batch", batch_file(content)])


def case(name, call, *match):
    return BadInput(name, call, CLIError, tuple(match))


CASES: list[BadInput] = [
    case("cli.kv_len_past_int32", cli("plan", "decode", "--kv-lens", "99999999999"),
         r"--kv-lens\[0\] = 99999999999", r"int32 limit " + LIMIT),
    case("cli.kv_lens_sum_past_int32",
         cli("plan", "decode", "--kv-lens", "2000000000,2000000000", "--json"),
         r"sum\(--kv-lens\) = 4000000000", r"int32 limit " + LIMIT),
    case("cli.prefill_kv_lens_sum_past_int32",
         cli("plan", "prefill", "--kv-lens", "2000000000,2000000000"),
         r"sum\(--kv-lens\) = 4000000000", LIMIT),
    case("cli.qo_len_past_int32",
         cli("plan", "decode", "--kv-lens", "5", "--qo-lens", "3000000000"),
         r"--qo-lens\[0\] = 3000000000", LIMIT),
    case("cli.negative_kv_len", cli("plan", "decode", "--kv-lens", "12,-3"),
         r"--kv-lens\[1\] = -3", r">= 0"),
    case("cli.kv_lens_not_integers", cli("plan", "decode", "--kv-lens", "12,x"),
         r"--kv-lens must be a comma-separated list of integers", r"'12,x'"),
    case("cli.kv_lens_empty", cli("plan", "decode", "--kv-lens", ","), r"--kv-lens",
         r"must not be empty"),
    case("cli.no_batch", cli("plan", "decode"), r"--kv-lens", r"--batch"),
    case("cli.qo_kv_count_mismatch", cli("plan", "decode", "--kv-lens", "5,6", "--qo-lens", "1"),
         r"--qo-lens has 1 entries", r"--kv-lens has 2"),
    case("cli.decode_qo_len_zero", cli("plan", "decode", "--kv-lens", "5", "--qo-lens", "0"),
         r"--qo-lens >= 1", r"decode"),
    case("cli.prefill_queries_over_keys",
         cli("plan", "prefill", "--kv-lens", "5", "--qo-lens", "9"), r"--qo-lens <= --kv-lens",
         r"causal"),
    case("cli.page_size_not_power_of_two",
         cli("plan", "decode", "--kv-lens", "5", "--page-size", "48"),
         r"--page-size must be a power of two", r"got 48"),
    case("cli.heads_not_positive", cli("plan", "decode", "--kv-lens", "5", "--heads", "0"),
         r"--heads must be >= 1", r"got 0"),
    case("cli.heads_unsupported", cli("plan", "decode", "--kv-lens", "5", "--heads", "20"),
         r"DecodePlanConfig\.num_heads", r"20"),
    case("cli.kv_granularity_not_positive",
         cli("plan", "decode", "--kv-lens", "5", "--kv-granularity", "0"),
         r"--kv-granularity must be >= 1", r"got 0"),
    case("cli.max_rows_negative", cli("plan", "decode", "--kv-lens", "5", "--max-rows", "-1"),
         r"--max-rows must be >= 0", r"got -1"),
    case("cli.unknown_device", cli("plan", "decode", "--kv-lens", "5", "--device", "tpu9"),
         r"--device", r"unknown device profile 'tpu9'"),
    case("cli.custom_device_cu_count",
         cli("plan", "decode", "--kv-lens", "5", "--device", "custom:abc"),
         r"--device custom:N needs an integer CU count", r"'custom:abc'"),
    case("cli.custom_device_arch",
         cli("plan", "decode", "--kv-lens", "5", "--device", "custom:8:sm80"),
         r"--device 'custom:8:sm80'", r"arch"),
    case("cli.batch_file_missing", cli("plan", "prefill", "--batch", "/nonexistent.json"),
         r"--batch '/nonexistent\.json'", r"No such file"),
    case("cli.batch_file_not_json", with_batch("{kv_lens: [1"), r"--batch '.*\.json'",
         r"Expecting"),
    case("cli.batch_file_not_an_object", with_batch([1, 2]), r"--batch", r"'kv_lens'"),
    case("cli.batch_file_strings", with_batch({"kv_lens": [4, "x"]}), r"kv_lens\[1\]",
         r"must be an integer, got 'x'"),
    case("cli.batch_file_floats", with_batch({"kv_lens": [4, 2.5]}), r"kv_lens\[1\]",
         r"got 2\.5"),
    case("cli.batch_file_past_int32", with_batch({"kv_lens": [2**31]}), r"kv_lens\[0\] = 2147483648",
         LIMIT),
    case("cli.batch_file_empty_list", with_batch({"kv_lens": []}), r"kv_lens must be a non-empty",
         r"\[\]"),
    case("cli.demo_page_size", cli("demo", "--page-sizes", "1,3"),
         r"--page-sizes\[1\] must be a power of two", r"got 3"),
    case("cli.plot_unwritable",
         cli("plan", "decode", "--kv-lens", "5", "--plot", "/nonexistent/dir/plan.png"),
         r"--plot '/nonexistent/dir/plan\.png'", r"'/nonexistent/dir' does not exist"),
]
