"""The hand-off's pure parts: the handle's and the read notice's wire forms, and the lease
table's claim and release rules."""

import pytest
import torch

from pdserve.engine.attention.kv_cache import KVCacheSpec
from pdserve.kv_transfer.handoff import (KVHandle, LeaseRefused, LeaseTable, ReadNotice, ReleaseReason, reason_from_wire,
                                         release_request)


SPEC = KVCacheSpec(num_layers=2, block_size=16, num_kv_heads=1, head_dim=4, dtype=torch.bfloat16)


def table_with_lease(ttl: float = 10.0):
    t = LeaseTable()
    lease = t.grant("req-a#0", [4, 9, 2], now=0.0, ttl_s=ttl)
    return t, lease


def refusal(fn) -> str:
    with pytest.raises(LeaseRefused) as info:
        fn()
    return info.value.reason


def test_the_handle_survives_the_wire_and_knows_its_last_block():
    h = KVHandle("10.0.0.5:7000", (4, 9, 2), num_tokens=37, lease_token="t0k")
    assert KVHandle.from_proto(h.to_proto()) == h
    # 37 = 16 + 16 + 5: the last block holds 5 tokens, and a layer-major block moves whole
    assert h.last_block_bytes(SPEC) == SPEC.block_bytes == 2 * 2 * 16 * 4 * 2


def test_a_partly_filled_block_moves_whole_and_an_impossible_tail_is_refused():
    for tokens in (1, 5, 16):
        assert SPEC.tail_bytes(tokens) == SPEC.block_bytes
    for tokens in (0, 17):
        with pytest.raises(ValueError, match="1..16 tokens"):
            SPEC.tail_bytes(tokens)


def test_tokens_are_secret_and_distinct():
    t = LeaseTable()
    tokens = {t.grant(f"r{i}", [i], 0.0, 1.0).token for i in range(50)}
    assert len(tokens) == 50 and all(len(tok) >= 32 for tok in tokens)


def test_a_claim_must_name_exactly_the_leases_blocks():
    t, lease = table_with_lease()
    other = t.grant("req-b#0", [1, 3], 0.0, 10.0)
    assert refusal(lambda: t.claim(lease.token, [4, 9, 2, 1], 1.0, 10.0)) == "blocks_mismatch"  # forged extra block
    assert refusal(lambda: t.claim(lease.token, list(other.block_ids), 1.0, 10.0)) == "blocks_mismatch"
    assert not lease.claimed and not t.read_allowed(lease.token, [1])


def test_unknown_expired_and_replayed_claims_are_refused():
    t, lease = table_with_lease(ttl=5.0)
    assert refusal(lambda: t.claim("guessed", [4, 9, 2], 1.0, 10.0)) == "unknown_token"
    assert refusal(lambda: t.claim(lease.token, [4, 9, 2], 5.0, 10.0)) == "expired"
    t2, lease2 = table_with_lease()
    t2.claim(lease2.token, [4, 9, 2], 1.0, 10.0)
    assert refusal(lambda: t2.claim(lease2.token, [4, 9, 2], 1.5, 10.0)) == "already_claimed"


def test_a_claim_renews_the_lease_for_the_read():
    t, lease = table_with_lease(ttl=5.0)
    t.claim(lease.token, [4, 9, 2], now=4.0, ttl_s=5.0)
    assert t.pop_expired(6.0) == []  # the grant's deadline passed; the claim's did not
    assert [l.token for l in t.pop_expired(9.0)] == [lease.token] and t.expired_total == 1


def test_reads_are_allowed_only_inside_a_claimed_lease():
    t, lease = table_with_lease()
    assert not t.read_allowed(lease.token, [4])  # not claimed yet
    t.claim(lease.token, [4, 9, 2], 1.0, 10.0)
    assert t.read_allowed(lease.token, [9, 2]) and not t.read_allowed(lease.token, [9, 5])
    t.release(lease.token, ReleaseReason.PULLED)
    assert not t.read_allowed(lease.token, [9])


def test_a_lease_handed_back_unread_stays_held_and_can_be_claimed_again():
    t, lease = table_with_lease()
    t.claim(lease.token, [4, 9, 2], 1.0, 10.0)
    assert t.release(lease.token, ReleaseReason.RETURNED) is lease
    assert len(t) == 1 and not t.read_allowed(lease.token, [4])
    assert t.claim(lease.token, [4, 9, 2], 2.0, 10.0) is lease
    assert t.released_by["returned"] == 1


def test_only_a_claimed_lease_can_be_handed_back_and_only_returned_keeps_a_lease():
    t, lease = table_with_lease()
    assert t.release(lease.token, ReleaseReason.RETURNED) is None  # nothing to hand back
    assert t.released_by["returned"] == 0 and len(t) == 1
    kept = [r for r in ReleaseReason if not r.ends_lease]
    assert kept == [ReleaseReason.RETURNED]


def test_a_read_notice_says_whether_the_read_ends_its_lease():
    for ends in (True, False):
        notice = ReadNotice("tok_en-1", ends_lease=ends)
        assert ReadNotice.decode(notice.encode()) == notice
        assert ReadNotice.decode(notice.encode().decode()) == notice
    assert ReadNotice("tok", ends_lease=True).encode() == b"tok"  # a last read's notify is the bare token


def test_an_early_read_is_allowed_by_its_claimed_lease_like_a_last_one():
    t, lease = table_with_lease()
    t.claim(lease.token, [4, 9, 2], 1.0, 10.0)
    early = ReadNotice(lease.token, ends_lease=False).encode().decode()
    assert t.read_allowed(early, [4, 9]) and not t.read_allowed(early, [5])


def test_each_release_reason_is_counted_once():
    t = LeaseTable()
    a, b = t.grant("a", [1], 0.0, 10.0), t.grant("b", [2], 0.0, 10.0)
    assert t.release(a.token, ReleaseReason.TRANSFER_FAILED).request_id == "a"
    assert t.release(a.token, ReleaseReason.ABORTED) is None
    t.release(b.token, reason_from_wire(release_request(b.token, ReleaseReason.ABORTED).reason))
    assert (t.released_by["transfer_failed"], t.released_by["aborted"], len(t)) == (1, 1, 0)


def test_the_handle_carries_its_blocks_checksums_over_the_wire():
    h = KVHandle("10.0.0.5:7000", (4, 9, 2), 37, "t0k", block_checksums=(2**64 - 1, 0, 12345))
    assert KVHandle.from_proto(h.to_proto()) == h
    t = LeaseTable()
    lease = t.grant("req-a#0", [4, 9, 2], 0.0, 10.0, checksums=(7, 8))
    assert KVHandle.of_lease("a:1", lease, 37).block_checksums == (7, 8)


def test_a_lease_checksums_each_block_once_it_is_final():
    """Full blocks as chunks finish them; the last, partly filled one with the prompt's end,
    over the bytes a read of it moves (all of it); none twice."""
    calls = []

    def sums(ids, last):
        calls.append((tuple(ids), last))
        return tuple(100 + i for i in ids)

    lease = LeaseTable().grant("req-a#0", [4, 9, 2], 0.0, 10.0)
    lease.checksum_final(sums, SPEC, num_tokens=15, done=False)  # no full block yet
    lease.checksum_final(sums, SPEC, num_tokens=20, done=False)
    lease.checksum_final(sums, SPEC, num_tokens=32, done=False)
    lease.checksum_final(sums, SPEC, num_tokens=37, done=True)
    lease.checksum_final(sums, SPEC, num_tokens=37, done=True)
    assert calls == [((4,), None), ((9,), None), ((2,), SPEC.block_bytes)]
    assert lease.checksums == [104, 109, 102]


def test_a_tensor_parallel_holders_checksums_count_one_per_rank_per_block():
    """A TP 2 holder gives two checksums a block (one per rank's part; the lease counts them): a streamed
    prompt's later chunks still sum the blocks after those summed, each once."""
    calls = []

    def sums(ids, last):
        calls.append(tuple(ids))
        return tuple(s for i in ids for s in (100 + i, 200 + i))

    lease = LeaseTable().grant("req-a#0", [4, 9, 2], 0.0, 10.0)
    for tokens, done in ((16, False), (32, False), (37, True), (37, True)):
        lease.checksum_final(sums, SPEC, num_tokens=tokens, done=done)
    assert calls == [(4,), (9,), (2,)]
    assert lease.checksums == [104, 204, 109, 209, 102, 202]


def test_a_reader_that_renews_its_claim_keeps_the_lease_past_its_deadline():
    """The holder cannot tell when a one-sided read ends: while the claim's reader renews it,
    expiry never frees the lease, however long past ``lease_seconds`` the read goes on. The
    old table expired it at the claim's deadline under a reader still reading."""
    t, lease = table_with_lease(ttl=5.0)
    t.claim(lease.token, [4, 9, 2], now=1.0, ttl_s=5.0)
    for now in (2.5, 4.0, 5.5, 7.0, 8.5, 10.0):  # every third of the lease, well past its first 6.0
        assert t.pop_expired(now) == []
        assert t.renew_claim(lease.token, now, ttl_s=5.0) is lease
    assert t.pop_expired(14.9) == [] and t.is_claimed(lease.token)
    assert [l.token for l in t.pop_expired(15.0)] == [lease.token]  # its reader stopped: it expires
    assert t.expired_total == 1 and t.renew_claim(lease.token, 15.0, 5.0) is None


def test_only_a_claimed_lease_is_renewed_by_its_reader():
    t, lease = table_with_lease(ttl=5.0)
    assert t.renew_claim(lease.token, 1.0, 50.0) is None  # unclaimed: a renewal is no claim
    assert t.renew_claim("guessed", 1.0, 50.0) is None
    assert [l.token for l in t.pop_expired(5.0)] == [lease.token]


def test_a_transfer_by_head_ends_its_lease_with_the_last_of_its_rank_pairs_reads():
    """Between tensor-parallel sizes every rank pair reads on its own; the holder frees the
    blocks only once each pair's last read has landed, whatever order they land in, and a
    pair's notice repeated does not count twice."""
    t, lease = table_with_lease()
    notices = [ReadNotice(lease.token, ends_lease=True, part=p, parts=3) for p in (2, 0, 2, 1)]
    assert [ReadNotice.decode(n.encode()) for n in notices] == notices
    assert notices[0].encode() == f"2/3:{lease.token}".encode()
    assert [t.read_ended(n) for n in notices] == [False, False, False, True]
    assert not t.read_ended(ReadNotice(lease.token, ends_lease=False))  # an early read never ends it
    assert t.read_ended(ReadNotice("any", ends_lease=True))  # one part: the read ends it, as before
    assert not t.read_ended(ReadNotice("gone", True, 0, 2))  # no such lease


def test_a_rank_pairs_notice_authorizes_its_tcp_read_like_a_plain_one():
    t, lease = table_with_lease()
    t.claim(lease.token, [4, 9, 2], 1.0, 10.0)
    note = ReadNotice(lease.token, True, 1, 2).encode().decode()
    assert t.read_allowed(note, [4, 9]) and not t.read_allowed(note, [5])
    assert ReadNotice.decode("9/2:" + lease.token).lease_token == "9/2:" + lease.token  # no such part: no lease


def test_a_tensor_parallel_lease_checksums_every_ranks_groups_a_block():
    calls = []

    def sums(ids, last):  # two ranks, two sums each a block
        calls.append((tuple(ids), last))
        return tuple(s for i in ids for s in (10 * i, 10 * i + 1, 10 * i + 2, 10 * i + 3))

    lease = LeaseTable().grant("req", [4, 9], 0.0, 10.0)  # learns the sums a block from the first
    lease.checksum_final(sums, SPEC, num_tokens=16, done=False)
    lease.checksum_final(sums, SPEC, num_tokens=20, done=True)
    assert calls == [((4,), None), ((9,), SPEC.block_bytes)]
    assert lease.checksums == [40, 41, 42, 43, 90, 91, 92, 93]
