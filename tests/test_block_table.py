"""BlockTable (eecore.engine.block_table): a list whose array must hold the same blocks after any
change, since the input builder copies step inputs from the array alone."""
from __future__ import annotations

import random

import numpy as np
import pytest

from eecore.engine.block_table import BlockTable
from eecore.engine.sequence import Sequence
from eecore.sampling_params import SamplingParams


def assert_in_step(table: BlockTable, expected: list[int]) -> None:
    assert list(table) == expected
    assert table.array.dtype == np.int32
    np.testing.assert_array_equal(table.array[: len(expected)], np.array(expected, dtype=np.int32))


def test_every_list_change_reaches_the_array():
    rng = random.Random(0)
    table, mirror = BlockTable(), []
    changes = [
        lambda t: t.append(rng.randrange(1000)),
        lambda t: t.extend(rng.randrange(1000) for _ in range(rng.randrange(0, 40))),  # a generator, as grow passes
        lambda t: t.pop() if t else None,
        lambda t: t.pop(rng.randrange(len(t))) if t else None,
        lambda t: t.pop(-2) if len(t) > 1 else None,
        lambda t: t.__setitem__(rng.randrange(len(t)), rng.randrange(1000)) if t else None,
        lambda t: t.__setitem__(slice(0, 2), [7, 8, 9]),
        lambda t: t.__delitem__(slice(0, rng.randrange(0, 3))),
        lambda t: t.insert(rng.randrange(len(t) + 1), rng.randrange(1000)),
        lambda t: t.remove(t[0]) if t else None,
        lambda t: t.__iadd__([rng.randrange(1000)]),
        lambda t: t.__imul__(2) if len(t) < 100 else None,
        lambda t: t.sort(),
        lambda t: t.reverse(),
        lambda t: t.clear() if rng.random() < 0.05 else None,
    ]
    for _ in range(3000):
        change = rng.choice(changes)
        state = rng.getstate()
        change(table)
        rng.setstate(state)  # the same change, with the same random numbers, on a plain list
        change(mirror)
        assert_in_step(table, mirror)


def test_the_array_grows_past_its_first_size():
    table = BlockTable(range(3))
    for block in range(3, 500):
        table.append(block)
    assert_in_step(table, list(range(500)))
    table.extend(range(500, 2000))
    assert_in_step(table, list(range(2000)))


def test_a_sequence_makes_any_table_it_is_given_a_block_table():
    seq = Sequence([1, 2, 3], SamplingParams(max_tokens=4))
    assert isinstance(seq.block_table, BlockTable) and seq.block_table == []
    seq.block_table = [5, 6]
    assert isinstance(seq.block_table, BlockTable)
    assert_in_step(seq.block_table, [5, 6])
    kept = seq.block_table
    seq.block_table.append(7)
    assert seq.block_table is kept  # the same object: decode ahead tells tables apart by identity
    seq.reset_for_recompute()
    assert isinstance(seq.block_table, BlockTable) and seq.block_table == [] and seq.block_table is not kept


@pytest.mark.parametrize("context_blocks", [1, 7, 300])
def test_the_builder_copies_tables_of_any_length(context_blocks):
    from eecore.engine.inputs import InputBuilder, Row

    bs = 4
    builder = InputBuilder(max_tokens=64, max_seqs=8, max_blocks_per_seq=512, block_size=bs,
                           device=__import__("torch").device("cpu"))
    rng = random.Random(context_blocks)
    rows = []
    for i in range(5):
        seq = Sequence([1] * 3, SamplingParams(max_tokens=4))
        blocks = rng.randrange(1, context_blocks + 1)
        seq.block_table = rng.sample(range(4096), blocks)
        rows.append(Row(seq, blocks * bs - 1, [9]))
    attn = builder.build(rows).attn
    tables = attn.block_table.numpy()
    for b, row in enumerate(rows):
        table = list(row.seq.block_table)
        assert tables[b, : len(table)].tolist() == table
        assert (tables[b, len(table):] == -1).all()
