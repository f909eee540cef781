/* LD_PRELOAD helper for device probes: on SIGSEGV/SIGABRT/SIGBUS, print the native stack (with
 * each frame's shared object and offset, for addr2line against the .so) to stderr, then die with
 * the same signal. Build: cc -shared -fPIC -O1 -o /tmp/segv.so bench/probes/segv_backtrace.c */
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

static void on_fault(int sig) {
    void *frames[64];
    int n = backtrace(frames, 64);
    const char *head = "\n[segv_backtrace] native stack:\n";
    (void)!write(2, head, strlen(head));
    backtrace_symbols_fd(frames, n, 2);
    signal(sig, SIG_DFL);
    raise(sig);
}

__attribute__((constructor)) static void install(void) {
    signal(SIGSEGV, on_fault);
    signal(SIGBUS, on_fault);
    signal(SIGABRT, on_fault);
}
