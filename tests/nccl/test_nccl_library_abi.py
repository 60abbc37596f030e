"""hora's ctypes declarations of NCCL against the C calling convention, on a machine without a GPU.

A real libnccl needs a GPU before ``ncclCommInitRank`` reads its arguments, so a C library with NCCL's
own signatures (from nccl.h) stands in for it here: it records what it received, and the test checks
that every argument arrived where NCCL would read it. ``ncclUniqueId`` is a 128-byte struct passed by
value; declaring it as a ctypes array passes a pointer instead, and the first real GPU run answered
"ncclCommInitRank failed: invalid argument".
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest

from hora.nccl import library

pytestmark = pytest.mark.timeout(60)

# What nccl.h declares, for the calls hora binds; each call records its scalar arguments.
_FAKE_NCCL = r"""
#include <stddef.h>
#include <string.h>
typedef struct { char internal[128]; } ncclUniqueId;
typedef void *ncclComm_t;
typedef void *cudaStream_t;
static ncclUniqueId last_id;
static long long last[8];

int ncclGetVersion(int *v) { *v = 22809; return 0; }
int ncclGetUniqueId(ncclUniqueId *id) { for (int i = 0; i < 128; i++) id->internal[i] = (char)(i * 7 + 3); return 0; }
const char *ncclGetErrorString(int r) {
    return r == 6 ? "remote process exited or there was a network error" : r ? "fake error" : "no error";
}
int ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank) {
    last_id = id; last[0] = nranks; last[1] = rank; *comm = (void *)0x1234; return 0;
}
int ncclCommDestroy(ncclComm_t c) { last[0] = (long long)c; return 0; }
int ncclCommAbort(ncclComm_t c) { last[0] = (long long)c; return 0; }
int ncclCommGetAsyncError(ncclComm_t c, int *e) { *e = c == (void *)0x66 ? 6 : 0; last[5] = (long long)c; return 0; }
int ncclGroupStart(void) { return 0; }
int ncclGroupEnd(void) { return 0; }
int ncclAllReduce(const void *s, void *r, size_t n, int t, int op, ncclComm_t c, cudaStream_t st) {
    last[0] = (long long)s; last[1] = (long long)r; last[2] = n; last[3] = t; last[4] = op;
    last[5] = (long long)c; last[6] = (long long)st; return 0;
}
int ncclReduceScatter(const void *s, void *r, size_t n, int t, int op, ncclComm_t c, cudaStream_t st) {
    return ncclAllReduce(s, r, n, t, op, c, st);
}
int ncclAllGather(const void *s, void *r, size_t n, int t, ncclComm_t c, cudaStream_t st) {
    last[0] = (long long)s; last[1] = (long long)r; last[2] = n; last[3] = t; last[5] = (long long)c;
    last[6] = (long long)st; return 0;
}
int ncclReduce(const void *s, void *r, size_t n, int t, int op, int root, ncclComm_t c, cudaStream_t st) {
    ncclAllReduce(s, r, n, t, op, c, st); last[7] = root; return 0;
}
int ncclBroadcast(const void *s, void *r, size_t n, int t, int root, ncclComm_t c, cudaStream_t st) {
    ncclAllGather(s, r, n, t, c, st); last[7] = root; return 0;
}
int ncclSend(const void *b, size_t n, int t, int peer, ncclComm_t c, cudaStream_t st) {
    last[0] = (long long)b; last[2] = n; last[3] = t; last[7] = peer; last[5] = (long long)c;
    last[6] = (long long)st; return 0;
}
int ncclRecv(void *b, size_t n, int t, int peer, ncclComm_t c, cudaStream_t st) {
    return ncclSend(b, n, t, peer, c, st);
}
int ncclRedOpCreatePreMulSum(int *op, void *scalar, int t, int residence, ncclComm_t c) {
    last[0] = *(float *)scalar * 1000; last[3] = t; last[4] = residence; last[5] = (long long)c; *op = 5; return 0;
}
int ncclRedOpDestroy(int op, ncclComm_t c) { last[4] = op; last[5] = (long long)c; return 0; }
void fakeLastId(ncclUniqueId *out) { *out = last_id; }
long long fakeLast(int i) { return last[i]; }
"""


@pytest.fixture(scope="module")
def fake(tmp_path_factory) -> ctypes.CDLL:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler here to build the stand-in libnccl (install gcc)")
    folder = tmp_path_factory.mktemp("fake_nccl")
    (folder / "fake_nccl.c").write_text(_FAKE_NCCL)
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(folder / "libnccl.so.2"),
                    str(folder / "fake_nccl.c")], check=True, capture_output=True, timeout=50)
    lib = ctypes.CDLL(str(folder / "libnccl.so.2"))
    lib.fakeLast.restype = ctypes.c_longlong
    return lib


def _last(lib: ctypes.CDLL) -> list[int]:
    return [lib.fakeLast(i) for i in range(8)]


def test_comm_init_rank_passes_the_unique_id_by_value(fake):
    nccl = library.Nccl(fake)
    uid = nccl.unique_id()
    assert uid == bytes((i * 7 + 3) % 256 for i in range(128))
    assert nccl.comm_init_rank(3, uid, 2) == 0x1234
    received = library.UniqueId()
    fake.fakeLastId(ctypes.byref(received))
    assert bytes(received) == uid  # NCCL reads the id's 128 bytes, not a pointer to them
    assert _last(fake)[:2] == [3, 2]


def test_collectives_pass_every_argument_in_its_place(fake):
    nccl = library.Nccl(fake)
    nccl.all_reduce(0x10, 0x20, 1 << 33, library.DataType.BFLOAT16, library.RedOp.MAX, 0x30, 0x40)
    assert _last(fake)[:7] == [0x10, 0x20, 1 << 33, 9, 2, 0x30, 0x40]
    nccl.broadcast(0x11, 0x21, 7, library.DataType.INT64, 3, 0x31, 0x41)
    last = _last(fake)
    assert last[:4] == [0x11, 0x21, 7, 4] and last[5:] == [0x31, 0x41, 3]
    nccl.reduce(0x12, 0x22, 8, library.DataType.FLOAT32, library.RedOp.SUM, 1, 0x32, 0x42)
    last = _last(fake)
    assert last[:5] == [0x12, 0x22, 8, 7, 0] and last[5:] == [0x32, 0x42, 1]
    nccl.send(0x13, 9, library.DataType.UINT8, 2, 0x33, 0x43)
    last = _last(fake)
    assert [last[0], last[2], last[3], last[5], last[6], last[7]] == [0x13, 9, 1, 0x33, 0x43, 2]


def test_premul_sum_passes_a_host_scalar_of_the_type(fake):
    nccl = library.Nccl(fake)
    assert nccl.premul_sum(0.25, library.DataType.FLOAT32, 0x35) == 5
    last = _last(fake)
    assert last[0] == 250 and last[3] == 7 and last[4] == 1 and last[5] == 0x35  # ncclScalarHostImmediate


def test_async_error_reads_the_communicators_result(fake):
    nccl = library.Nccl(fake)
    assert nccl.comm_get_async_error(0x65) == 0 and _last(fake)[5] == 0x65
    assert nccl.comm_get_async_error(0x66) == 6
    assert nccl.error_string(6) == "remote process exited or there was a network error"
