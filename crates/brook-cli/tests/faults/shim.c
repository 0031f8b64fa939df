/* Fault injection for brook's tests, loaded with LD_PRELOAD into the `brook` binary.
 *
 * Real faults at the system-call boundary, on regular files only (so the pipes of stdout and
 * stderr are untouched), chosen by environment variables:
 *   BROOK_FAULT=enospc  writes fail with ENOSPC once BROOK_FAULT_AFTER bytes were written
 *   BROOK_FAULT=eio     writes fail with EIO the same way
 *   BROOK_FAULT=short   every write and pwrite of more than one byte writes only half
 *   BROOK_FAULT=readeio reads fail with EIO once BROOK_FAULT_AFTER bytes were read
 *   BROOK_FAULT=shortread every read and pread returns at most half of what was asked
 *   BROOK_FAULT=slow    every write sleeps BROOK_FAULT_AFTER microseconds first (so a test can
 *                       kill the process at a random point of a run that is otherwise quick)
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

enum { NONE, ENOSPC_W, EIO_W, SHORT_W, EIO_R, SLOW_W, SHORT_R };
static int mode = NONE;
static long long after = 0;
static _Atomic long long written = 0, readn = 0;

__attribute__((constructor)) static void init(void) {
    const char *m = getenv("BROOK_FAULT");
    const char *a = getenv("BROOK_FAULT_AFTER");
    if (!m) return;
    if (!strcmp(m, "enospc")) mode = ENOSPC_W;
    else if (!strcmp(m, "eio")) mode = EIO_W;
    else if (!strcmp(m, "short")) mode = SHORT_W;
    else if (!strcmp(m, "readeio")) mode = EIO_R;
    else if (!strcmp(m, "slow")) mode = SLOW_W;
    else if (!strcmp(m, "shortread")) mode = SHORT_R;
    after = a ? atoll(a) : 0;
}

/* Regular files other than stdin, stdout and stderr (which a test may redirect to a file). */
static int regular(int fd) {
    struct stat st;
    return fd > 2 && fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
}

/* 1 when this write must fail (errno set), else 0; may shorten *n. */
static int write_fault(int fd, size_t *n) {
    if (mode == NONE || mode == EIO_R || mode == SHORT_R || !regular(fd)) return 0;
    if (mode == SLOW_W) {
        usleep((useconds_t)after);
        return 0;
    }
    if (mode == SHORT_W) {
        /* O_DIRECT writes must stay in whole blocks: shorten those to a 4 KiB multiple. */
        if (fcntl(fd, F_GETFL) & O_DIRECT) {
            size_t half = (*n / 2) & ~(size_t)4095;
            if (half > 0) *n = half;
        } else if (*n > 1) {
            *n /= 2;
        }
        return 0;
    }
    long long before = atomic_fetch_add(&written, (long long)*n);
    if (before + (long long)*n > after) {
        errno = mode == ENOSPC_W ? ENOSPC : EIO;
        return 1;
    }
    return 0;
}

/* Halves *n for BROOK_FAULT=shortread (whole 4 KiB blocks on O_DIRECT descriptors). */
static void shorten_read(int fd, size_t *n) {
    if (mode != SHORT_R || !regular(fd)) return;
    if (fcntl(fd, F_GETFL) & O_DIRECT) {
        size_t half = (*n / 2) & ~(size_t)4095;
        if (half > 0) *n = half;
    } else if (*n > 1) {
        *n /= 2;
    }
}

static int read_fault(int fd, size_t n) {
    if (mode != EIO_R || !regular(fd)) return 0;
    long long before = atomic_fetch_add(&readn, (long long)n);
    if (before + (long long)n > after) {
        errno = EIO;
        return 1;
    }
    return 0;
}

typedef ssize_t (*write_fn)(int, const void *, size_t);
typedef ssize_t (*pwrite_fn)(int, const void *, size_t, off_t);
typedef ssize_t (*writev_fn)(int, const struct iovec *, int);
typedef ssize_t (*read_fn)(int, void *, size_t);
typedef ssize_t (*pread_fn)(int, void *, size_t, off_t);

#define REAL(name, T) static T real_##name; if (!real_##name) real_##name = (T)dlsym(RTLD_NEXT, #name)

ssize_t write(int fd, const void *buf, size_t n) {
    REAL(write, write_fn);
    if (write_fault(fd, &n)) return -1;
    return real_write(fd, buf, n);
}

ssize_t pwrite64(int fd, const void *buf, size_t n, off_t off) {
    REAL(pwrite64, pwrite_fn);
    if (write_fault(fd, &n)) return -1;
    return real_pwrite64(fd, buf, n, off);
}

ssize_t pwrite(int fd, const void *buf, size_t n, off_t off) {
    REAL(pwrite, pwrite_fn);
    if (write_fault(fd, &n)) return -1;
    return real_pwrite(fd, buf, n, off);
}

ssize_t writev(int fd, const struct iovec *iov, int cnt) {
    REAL(writev, writev_fn);
    if (mode != NONE && mode != EIO_R && regular(fd) && cnt > 0) {
        /* One piece at a time keeps the accounting (and short writes) simple. */
        size_t n = iov[0].iov_len;
        if (write_fault(fd, &n)) return -1;
        REAL(write, write_fn);
        return real_write(fd, iov[0].iov_base, n);
    }
    return real_writev(fd, iov, cnt);
}

ssize_t read(int fd, void *buf, size_t n) {
    REAL(read, read_fn);
    if (read_fault(fd, n)) return -1;
    shorten_read(fd, &n);
    return real_read(fd, buf, n);
}

ssize_t pread64(int fd, void *buf, size_t n, off_t off) {
    REAL(pread64, pread_fn);
    if (read_fault(fd, n)) return -1;
    shorten_read(fd, &n);
    return real_pread64(fd, buf, n, off);
}

ssize_t pread(int fd, void *buf, size_t n, off_t off) {
    REAL(pread, pread_fn);
    if (read_fault(fd, n)) return -1;
    shorten_read(fd, &n);
    return real_pread(fd, buf, n, off);
}
