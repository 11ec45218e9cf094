"""The benchmark table printer: columns as wide as their widest cell, and a table with no rows (a part that was
skipped or ran out of time) prints its header instead of failing the run after its results were measured."""

import io

from specsplit.bench.records import print_table


def test_columns_fit_their_widest_cell_and_an_empty_table_prints_its_header():
    out = io.StringIO()
    print_table([{"mode": "in_process", "tokens_per_s": 205.3}, {"mode": "split"}], ["mode", "tokens_per_s"], out)
    assert out.getvalue().splitlines() == ["mode        tokens_per_s", "in_process  205.300     ",
                                           "split                   "]  # a missing cell is blank
    empty = io.StringIO()
    print_table([], ["batch", "k"], empty)
    assert empty.getvalue() == "batch  k\n"
