"""Per-tenant admission (``pdserve.router.tenant_admission``), as plain state with a fake clock:
each limit refuses its own tenant's excess, names the limit, frees as requests end, and never
touches another tenant."""

import grpc
import pytest

from pdserve.router.tenant_admission import TenantAdmission, TenantLimitError
from pdserve.router.tenants import Tenant, TenantLimits
from tests.metrics.metrics_helpers import FakeClock

A = Tenant("team-a", TenantLimits(max_concurrent_requests=3, max_waiting_requests=2))
B = Tenant("team-b")


def refused(admission: TenantAdmission, tenant: Tenant) -> TenantLimitError:
    with pytest.raises(TenantLimitError) as err:
        admission.admit(tenant)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and tenant.name in str(err.value)
    return err.value


def test_waiting_then_concurrent_limits_refuse_only_their_tenant():
    admission = TenantAdmission()
    first, second = admission.admit(A), admission.admit(A)
    assert refused(admission, A).limit == "max_waiting_requests"
    others = [admission.admit(B) for _ in range(50)]  # B has no limits: A's do not reach it
    first.started()  # its first token: no longer waiting, still running
    third = admission.admit(A)
    second.started(), third.started()
    err = refused(admission, A)
    assert err.limit == "max_concurrent_requests" and "max_concurrent_requests=3" in str(err)
    first.done()
    admission.admit(A)  # room again
    assert admission.usage("team-a")[:2] == (3, 1) and admission.usage("team-b")[:2] == (50, 50)
    for ticket in others:
        ticket.done()
    assert admission.usage("team-b")[:2] == (0, 0)


def test_done_is_counted_once_whatever_happened_before():
    admission = TenantAdmission()
    ticket = admission.admit(A)
    ticket.done()
    ticket.done()
    ticket.started()
    assert admission.usage("team-a")[:2] == (0, 0)


def test_tokens_per_minute_refuses_until_the_window_slides_and_says_when():
    clock = FakeClock(1000.0)
    tenant = Tenant("team-c", TenantLimits(tokens_per_minute=100))
    admission = TenantAdmission(clock=clock)
    t = admission.admit(tenant)
    t.used(60)  # its prompt
    clock.advance(10)
    t.used(50)  # its output, past the limit: a request is not cut short
    t.done()
    err = refused(admission, tenant)
    assert err.limit == "tokens_per_minute" and "110 tokens" in str(err)
    assert err.retry_after_s == 50  # the prompt's 60 leave the window 60 s after they were used
    clock.advance(50)
    admission.admit(tenant).done()
    assert admission.usage("team-c")[2] == 50


def test_no_tenant_is_not_counted():
    admission = TenantAdmission()
    ticket = admission.admit(None)
    ticket.used(10**9)
    ticket.started()
    ticket.done()
