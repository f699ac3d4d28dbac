"""InputBuilder's whole-array build against a row-by-row reference, on random steps: plain rows of
several tokens (prefill chunks, verify passes), token trees beside chains, rows padded to a width
and to a batch size, block tables of every length."""
from __future__ import annotations

import random

import pytest
import torch

import eecore
from eecore.engine.inputs import InputBuilder, Row, tree_depths_and_masks
from eecore.engine.sequence import Sequence

BLOCK, PAD_BLOCK, MAX_BLOCKS = 4, 63, 6


def reference(rows: list[Row], pad_to, width: int) -> dict[str, list]:
    """What each tensor of the step must hold, written one row and one token at a time."""
    out = dict(tokens=[], positions=[], slots=[], seq_lens=[], qsl=[0], tables=[], tree=[])
    has_tree = any(r.parents is not None for r in rows)
    table_width = MAX_BLOCKS if pad_to is not None else max(len(r.seq.block_table) for r in rows)
    for row in rows:
        n = width if pad_to is not None else len(row.tokens)
        table = row.seq.block_table
        depths = tree_depths_and_masks(row.parents)[0] if row.parents else None
        for j in range(n):
            real = j < len(row.tokens)
            out["tokens"].append(row.tokens[j] if real else row.tokens[-1])
            slot_pos = row.start + j
            out["slots"].append(table[slot_pos // BLOCK] * BLOCK + slot_pos % BLOCK)
            if depths is not None:
                out["positions"].append(row.start + int(depths[j]))
            else:
                out["positions"].append(row.start + min(j, len(row.tokens) - 1))
            if has_tree:
                out["tree"].append(int(tree_depths_and_masks(row.parents)[1][j]) if row.parents
                                   else (1 << (j + 1)) - 1)
        out["seq_lens"].append(row.start + n)
        out["qsl"].append(out["qsl"][-1] + n)
        out["tables"].append(table + [-1] * (table_width - len(table)))
    for _ in range(len(rows), pad_to or 0):
        for j in range(width):
            out["tokens"].append(0)
            out["positions"].append(j)
            out["slots"].append(PAD_BLOCK * BLOCK + j % BLOCK)
        out["seq_lens"].append(width)
        out["qsl"].append(out["qsl"][-1] + width)
        blocks = -(-width // BLOCK)
        out["tables"].append([PAD_BLOCK] * blocks + [-1] * (table_width - blocks))
    out["last"] = [q - 1 for q in out["qsl"][1:]]
    return out


def random_tree(rng: random.Random, n: int) -> list[int]:
    return [-1] + [rng.randrange(j) for j in range(1, n)]


def random_step(rng: random.Random, padded: bool):
    width = rng.randint(1, 5) if padded else 1
    num_rows = rng.randint(1, 6)
    trees = not padded and rng.random() < 0.5
    rows = []
    for _ in range(num_rows):
        n = rng.randint(1, width) if padded else rng.randint(0, 7)  # varlen steps may hold empty rows
        span = max(n, width, 1)  # slots the row writes (a padded row: its width)
        start = rng.randint(0, MAX_BLOCKS * BLOCK - span)
        seq = Sequence([1], eecore.SamplingParams(max_tokens=4))
        needed = -(-(start + span) // BLOCK)
        seq.block_table = rng.sample(range(PAD_BLOCK), rng.randint(needed, MAX_BLOCKS))
        parents = random_tree(rng, n) if trees and n and rng.random() < 0.5 else None
        rows.append(Row(seq, start, [rng.randrange(1000) for _ in range(n)], parents))
    pad_to = rng.randint(num_rows, 8) if padded else None
    return rows, pad_to, width


@pytest.mark.parametrize("padded", [False, True], ids=["varlen", "padded"])
def test_build_matches_the_row_by_row_reference(padded):
    rng = random.Random(11 + padded)
    builder = InputBuilder(max_tokens=64, max_seqs=8, max_blocks_per_seq=MAX_BLOCKS, block_size=BLOCK,
                           device=torch.device("cpu"), pad_block=PAD_BLOCK)
    for _ in range(200):
        rows, pad_to, width = random_step(rng, padded)
        inputs = builder.build(rows, pad_to=pad_to, width=width)
        want = reference(rows, pad_to, width)
        attn = inputs.attn
        got = dict(tokens=inputs.token_ids, positions=attn.positions, slots=attn.slot_mapping,
                   seq_lens=attn.seq_lens, qsl=attn.query_start_loc, tables=attn.block_table,
                   last=inputs.last_rows, tree=attn.tree_mask if attn.tree_mask is not None else torch.empty(0))
        for name, tensor in got.items():
            assert tensor.tolist() == want[name], (name, rows, pad_to, width)
        assert attn.max_query_len == max(b - a for a, b in zip(want["qsl"], want["qsl"][1:]))


def test_a_row_past_its_block_table_is_refused():
    builder = InputBuilder(max_tokens=16, max_seqs=4, max_blocks_per_seq=3, block_size=4, device=torch.device("cpu"))
    seq = Sequence([1, 2, 3], eecore.SamplingParams(max_tokens=4))
    seq.block_table = [5]
    with pytest.raises(RuntimeError, match="row 0 writes position 4, past the 1 blocks of its sequence's block table"):
        builder.build([Row(seq, 3, [7, 8])])


def test_step_buffers_pack_a_step_for_one_copy():
    """A step's arrays lie one after another in one buffer, so one copy of its bytes fills the
    device's tensors (a CPU tensor stands in for the device buffer here); no two arrays overlap."""
    from eecore.engine.step_buffers import StepBuffers

    nbytes = StepBuffers.nbytes_of(max_tokens=64, max_seqs=8, max_blocks=10, has_tree=True)
    host, device = torch.zeros(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    buffers = StepBuffers(host, device, T=20, B=4, table_width=7, has_tree=True)
    for i, array in enumerate(buffers.arrays.values()):
        array[...] = 1000 * i + torch.arange(array.size).view(array.shape).numpy()
    buffers.device_bytes.copy_(buffers.host_bytes)
    for i, (name, array) in enumerate(buffers.arrays.items()):
        assert torch.equal(buffers.device[name], buffers.host[name]), name
        assert (buffers.device[name].flatten() - 1000 * i).tolist() == list(range(array.size)), name
    assert buffers.device["tables"].shape == (4, 7) and buffers.device["qsl"].dtype == torch.int32
    assert buffers.host_bytes.numel() <= nbytes


def _fields(inputs) -> list:
    a = inputs.attn
    return [t.tolist() for t in (inputs.token_ids, a.positions, a.slot_mapping, a.block_table, a.seq_lens,
                                 a.query_start_loc, inputs.last_rows)] + [inputs.row_lens, a.max_query_len]


def test_an_advanced_step_is_the_step_built_anew():
    """InputBuilder.advance (a draft chain's next pass from the last pass's arrays): random padded
    steps (the first of 1-5 tokens a row, padded to a width: a draft copy's catch-up) advanced pass
    after pass, rows crossing into blocks their tables held, tables gaining blocks and chains
    ending between passes (the rest padded to another size), give the arrays of a fresh build of
    the same rows."""
    rng = random.Random(5)
    advanced = 0
    for _ in range(80):
        chain = InputBuilder(max_tokens=64, max_seqs=8, max_blocks_per_seq=MAX_BLOCKS, block_size=BLOCK,
                             device=torch.device("cpu"), pad_block=PAD_BLOCK)
        fresh = InputBuilder(max_tokens=64, max_seqs=8, max_blocks_per_seq=MAX_BLOCKS, block_size=BLOCK,
                             device=torch.device("cpu"), pad_block=PAD_BLOCK)
        seqs, starts = [], []
        first_width = rng.choice([1, 1, 2, 3, 5])
        for _ in range(rng.randint(1, 6)):
            seq = Sequence([1], eecore.SamplingParams(max_tokens=4))
            start = rng.randint(0, MAX_BLOCKS * BLOCK - 6 - first_width)
            seq.block_table = rng.sample(range(PAD_BLOCK),
                                         rng.randint((start + first_width - 1) // BLOCK + 1, MAX_BLOCKS))
            seqs.append(seq)
            starts.append(start)
        pad_to = rng.randint(len(seqs), 8)
        rows = [Row(s, p, [rng.randrange(1000) for _ in range(rng.randint(1, first_width))])
                for s, p in zip(seqs, starts)]
        width = chain.table_width_bucket(rows, first_width)
        chain.build(rows, pad_to=pad_to, width=first_width, table_width=width)
        held = [len(s.block_table) for s in seqs]  # the blocks the built arrays' tables hold, by row
        for _ in range(4):
            if rng.random() < 0.3:  # a table gains a block (held by the last pass's arrays or not)
                seq = rng.choice(seqs)
                if len(seq.block_table) < MAX_BLOCKS:
                    seq.block_table.append(rng.choice([b for b in range(PAD_BLOCK) if b not in seq.block_table]))
            if len(rows) > 1 and rng.random() < 0.4:  # some chains end: the others go on, in order
                keep = sorted(rng.sample(range(len(rows)), rng.randint(1, len(rows) - 1)))
                rows, held = [rows[i] for i in keep], [held[i] for i in keep]
                pad_to = rng.randint(len(rows), pad_to)
            rows = [Row(r.seq, r.start + len(r.tokens), [rng.randrange(1000)]) for r in rows]
            if any(r.start >= len(r.seq.block_table) * BLOCK for r in rows):
                break
            got = chain.advance(rows, pad_to)
            assert (got is None) == any(r.start // BLOCK >= n for r, n in zip(rows, held))
            if got is None:  # past the blocks the built arrays' tables held: built anew
                got = chain.build(rows, pad_to=pad_to, table_width=chain.table_width_bucket(rows)), None
                held = [len(r.seq.block_table) for r in rows]
            else:
                advanced += 1
            inputs, width = got
            want = fresh.build(rows, pad_to=pad_to, table_width=width or fresh.table_width_bucket(rows))
            fields = _fields(inputs)
            for name, value, expected in zip(("tokens", "positions", "slots"), fields, _fields(want)):
                assert value == expected, name
            assert fields[4:] == _fields(want)[4:]
            # the tables: each row's blocks as the last full build held them (a block appended since
            # is read by no row of the pass), the padding rows' as built anew
            tables, fresh_tables = fields[3], _fields(want)[3]
            for i, (r, n) in enumerate(zip(rows, held)):
                assert tables[i] == r.seq.block_table[:n] + [-1] * (len(tables[i]) - n)
            assert tables[len(rows):] == fresh_tables[len(rows):]
    assert advanced > 130


@pytest.mark.parametrize("change", ["other sequence", "out of order", "other start", "two tokens", "a varlen build",
                                    "past its table", "inside a wider step"])
def test_a_step_that_does_not_follow_the_last_is_not_advanced(change):
    builder = InputBuilder(max_tokens=16, max_seqs=4, max_blocks_per_seq=4, block_size=4,
                           device=torch.device("cpu"), pad_block=9)
    seqs = [Sequence([1, 2, 3, 4, 5], eecore.SamplingParams(max_tokens=9)),
            Sequence([6, 7, 8], eecore.SamplingParams(max_tokens=9))]
    seqs[0].block_table, seqs[1].block_table = [2, 5], [7]
    rows = [Row(seqs[0], 5, [11]), Row(seqs[1], 2, [12])]
    builder.build(rows, pad_to=2, table_width=builder.table_width_bucket(rows))
    following = [Row(seqs[0], 6, [21]), Row(seqs[1], 3, [22])]
    if change == "other sequence":
        other = Sequence([1, 2, 3, 4, 5, 6], eecore.SamplingParams(max_tokens=9))
        other.block_table = [4, 6]
        following[0] = Row(other, 6, [21])
    elif change == "out of order":
        following.reverse()
    elif change == "other start":
        following[0] = Row(seqs[0], 7, [21])
    elif change == "two tokens":
        following[0] = Row(seqs[0], 6, [21, 23])
    elif change == "a varlen build":
        builder.build(rows)
    elif change == "inside a wider step":  # the last step ran two tokens a row: position 6 is its own
        rows = [Row(seqs[0], 5, [11, 13]), Row(seqs[1], 2, [12])]
        builder.build(rows, pad_to=2, width=2, table_width=builder.table_width_bucket(rows, 2))
    else:
        following[1] = Row(seqs[1], 4, [22])
        rows = [rows[0], Row(seqs[1], 3, [12])]
        builder.build(rows, pad_to=2, table_width=builder.table_width_bucket(rows))
        seqs[1].block_table.append(3)  # position 4 starts a block the last pass's tables did not hold
    assert builder.advance(following, 2) is None
    assert builder.advanced_steps == 0
