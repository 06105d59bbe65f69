import pytest
import torch

from cache_api import CacheError, CacheFullError, KVCache, RowTable

LAYERS, ROWS, KVH, POS, DIM = 2, 3, 2, 8, 4


def make_cache() -> KVCache:
    return KVCache(LAYERS, ROWS, KVH, POS, DIM)


def kv(t: int, fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full((LAYERS, KVH, t, DIM), fill), torch.full((LAYERS, KVH, t, DIM), -fill)


def test_allocate_hands_out_lowest_free_row_and_reuses_removed_rows():
    cache = make_cache()
    assert [cache.allocate() for _ in range(3)] == [0, 1, 2]
    cache.remove(1)
    assert cache.occupancy().rows_used == 2
    assert cache.allocate() == 1


def test_insert_writes_only_its_row_and_sets_length():
    cache = make_cache()
    a, b = cache.allocate(), cache.allocate()
    cache.insert(b, *kv(3, 2.0))
    cache.insert(a, *kv(5, 1.0))
    keys, values = cache.row_keys(b)
    assert keys.shape == (LAYERS, KVH, 3, DIM)
    assert torch.all(keys == 2.0) and torch.all(values == -2.0)
    assert cache.rows.length(a) == 5
    assert cache.occupancy().positions_used == 8


def test_append_adds_one_position_per_row():
    cache = make_cache()
    a, b = cache.allocate(), cache.allocate()
    cache.insert(a, *kv(2, 1.0))
    cache.insert(b, *kv(4, 1.0))
    new = torch.arange(LAYERS * 2 * KVH * DIM, dtype=torch.float32).view(LAYERS, 2, KVH, DIM)
    cache.append([a, b], new, -new)
    assert cache.rows.lengths([a, b]) == [3, 5]
    assert torch.equal(cache.k[:, a, :, 2], new[:, 0])
    assert torch.equal(cache.v[:, b, :, 4], -new[:, 1])


def test_copy_duplicates_a_prefix_into_another_row():
    cache = make_cache()
    src, dst = cache.allocate(), cache.allocate()
    keys = torch.randn(LAYERS, KVH, 6, DIM)
    cache.insert(src, keys, keys * 2)
    cache.copy(src, dst, 4)
    copied_k, copied_v = cache.row_keys(dst)
    assert torch.equal(copied_k, keys[:, :, :4])
    assert torch.equal(copied_v, keys[:, :, :4] * 2)


def test_occupancy_counts_rows_and_positions():
    cache = make_cache()
    row = cache.allocate()
    cache.insert(row, *kv(7, 0.5))
    occ = cache.occupancy()
    assert (occ.rows_total, occ.rows_used, occ.rows_free, occ.positions_used) == (3, 1, 2, 7)
    cache.remove(row)
    assert cache.occupancy().rows_used == 0 and cache.occupancy().positions_used == 0


def test_double_remove_is_refused():
    cache = make_cache()
    row = cache.allocate()
    cache.remove(row)
    with pytest.raises(CacheError, match="not allocated"):
        cache.remove(row)


@pytest.mark.parametrize("row", [-1, ROWS, 99])
def test_row_out_of_range_is_refused(row):
    cache = make_cache()
    with pytest.raises(CacheError, match="out of range"):
        cache.remove(row)
    with pytest.raises(CacheError, match="out of range"):
        cache.insert(row, *kv(1, 1.0))


def test_writing_past_n_positions_is_refused():
    cache = make_cache()
    row = cache.allocate()
    with pytest.raises(CacheError, match="exceed"):
        cache.insert(row, *kv(POS + 1, 1.0))
    cache.insert(row, *kv(POS, 1.0))
    with pytest.raises(CacheError, match="full"):
        cache.append([row], torch.zeros(LAYERS, 1, KVH, DIM), torch.zeros(LAYERS, 1, KVH, DIM))
    assert cache.rows.length(row) == POS


def test_allocating_when_full_is_refused():
    cache = make_cache()
    for _ in range(ROWS):
        cache.allocate()
    with pytest.raises(CacheFullError, match="all 3 KV rows"):
        cache.allocate()


def test_insert_into_a_free_row_and_bad_shapes_are_refused():
    cache = make_cache()
    with pytest.raises(CacheError, match="not allocated"):
        cache.insert(0, *kv(2, 1.0))
    row = cache.allocate()
    with pytest.raises(CacheError, match="expected"):
        cache.insert(row, torch.zeros(LAYERS, KVH + 1, 2, DIM), torch.zeros(LAYERS, KVH + 1, 2, DIM))


def test_copy_longer_than_source_is_refused():
    cache = make_cache()
    src, dst = cache.allocate(), cache.allocate()
    cache.insert(src, *kv(2, 1.0))
    with pytest.raises(CacheError, match="cannot copy 3"):
        cache.copy(src, dst, 3)
    with pytest.raises(CacheError, match="same row"):
        cache.copy(src, src, 1)


def test_caches_sharing_a_row_table_allocate_once():
    rows = RowTable(ROWS, POS)
    rank0 = KVCache(LAYERS, ROWS, 1, POS, DIM, rows=rows)
    rank1 = KVCache(LAYERS, ROWS, 1, POS, DIM, rows=rows)
    row = rank0.allocate()
    assert rank1.occupancy().rows_used == 1
    rank1.insert(row, torch.ones(LAYERS, 1, 3, DIM), torch.ones(LAYERS, 1, 3, DIM))
    assert rank0.rows.length(row) == 3
    with pytest.raises(ValueError, match="different shape"):
        KVCache(LAYERS, ROWS + 1, 1, POS, DIM, rows=rows)


def test_copy_leaves_the_source_untouched_and_truncates_a_longer_destination():
    cache = make_cache()
    src, dst, other = cache.allocate(), cache.allocate(), cache.allocate()
    keys = torch.randn(LAYERS, KVH, 6, DIM)
    cache.insert(src, keys, -keys)
    cache.insert(dst, *kv(7, 9.0))
    cache.insert(other, *kv(2, 3.0))
    cache.copy(src, dst, 3)
    assert cache.rows.lengths([src, dst, other]) == [6, 3, 2]
    assert torch.equal(cache.row_keys(src)[0], keys) and torch.equal(cache.row_keys(src)[1], -keys)
    assert torch.equal(cache.row_keys(dst)[0], keys[:, :, :3])
    assert torch.all(cache.row_keys(other)[0] == 3.0)
    cache.copy(src, dst, 0)
    assert cache.rows.length(dst) == 0
    cache.remove(other)
    with pytest.raises(CacheError, match="not allocated"):
        cache.copy(other, dst, 1)
    with pytest.raises(CacheError, match="not allocated"):
        cache.copy(src, other, 1)


def test_a_removed_row_can_retain_its_prefix_until_claimed():
    cache = make_cache()
    a, b, c = cache.allocate(), cache.allocate(), cache.allocate()
    keys = torch.randn(LAYERS, KVH, 5, DIM)
    cache.insert(a, keys, keys)
    cache.insert(b, *kv(4, 1.0))
    generation = cache.rows.generation(a)
    cache.remove(a, keep=4)
    assert cache.rows.retained(a) == 4 and cache.occupancy().rows_used == 2
    with pytest.raises(CacheError, match="not allocated"):
        cache.rows.length(a)
    cache.remove(c)
    assert cache.allocate() == c  # a clean row goes before a retained one
    claimed = cache.allocate(a, keep=3)
    assert claimed == a and cache.rows.length(a) == 3 and cache.rows.retained(a) == 0
    assert cache.rows.generation(a) == generation + 1
    assert torch.equal(cache.row_keys(a)[0], keys[:, :, :3])


def test_retained_rows_are_reallocated_lowest_first():
    cache = make_cache()
    rows = [cache.allocate() for _ in range(ROWS)]
    for row in rows:
        cache.insert(row, *kv(2, 1.0))
    for row in (2, 0, 1):
        cache.remove(row, keep=2)
    assert [cache.allocate() for _ in range(ROWS)] == [0, 1, 2]
    assert all(cache.rows.retained(r) == 0 and cache.rows.length(r) == 0 for r in rows)


def test_bad_retention_and_claims_are_refused():
    cache = make_cache()
    a, b = cache.allocate(), cache.allocate()
    cache.insert(a, *kv(2, 1.0))
    with pytest.raises(CacheError, match="cannot keep 3"):
        cache.remove(a, keep=3)
    cache.remove(a, keep=2)
    with pytest.raises(CacheError, match="retains 2 positions, not 3"):
        cache.allocate(a, keep=3)
    with pytest.raises(CacheError, match="already in use"):
        cache.allocate(b)
    with pytest.raises(CacheError, match="needs the retained row"):
        cache.allocate(keep=1)
    assert cache.allocate(2) == 2  # a clean row may be claimed by number too
    assert cache.allocate() == a and cache.rows.length(a) == 0
