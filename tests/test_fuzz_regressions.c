/*
 * Replays the fuzz inputs through the fuzz targets' own entry points (fuzz/fuzz_*.c,
 * included here with KVW_FUZZ_NO_ENTRY): every file under fuzz/regressions/<target>/
 * (inputs that once crashed a target or tripped one of its oracles) and every seed
 * under fuzz/corpus/<target>/. Each input runs in its own child process, so a crash is
 * reported per file; a child that runs longer than 15 s counts as a hang (the targets
 * finish any input in milliseconds).
 *
 * Built with the ordinary compiler and flags: without sanitizers an out-of-bounds access
 * may go unnoticed here, but crashes (SIGFPE, SIGSEGV), the targets' oracles (abort with
 * "FUZZ ORACLE") and hangs are caught; under `make check-asan` everything is.
 *
 * KVW_SOURCE_DIR (set by CTest) locates the tree. Usage: test_fuzz_regressions [FILE...]
 * replays only the given files (target chosen by the parent directory's name).
 * Exit: 0 every input ran clean, 1 otherwise.
 */
#define KVW_FUZZ_NO_ENTRY 1
#include "../fuzz/fuzz_frame.c"
#include "../fuzz/fuzz_hello.c"
#include "../fuzz/fuzz_plan.c"
#include "../fuzz/fuzz_tcp_rx.c"

#include "timeout.h"

#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>

typedef int (*target_fn)(const uint8_t *data, size_t size);

static const struct {
    const char *name;
    target_fn fn;
} targets[] = {
    {"fuzz_frame", kvw_fuzz_frame},
    {"fuzz_hello", kvw_fuzz_hello},
    {"fuzz_plan", kvw_fuzz_plan},
    {"fuzz_tcp_rx", kvw_fuzz_tcp_rx},
};

#define NUM_TARGETS (sizeof(targets) / sizeof(targets[0]))

static int g_ran, g_failed;

static uint8_t *read_file(const char *path, size_t *len_p)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return NULL;
    size_t cap = 4096, n = 0;
    uint8_t *b = malloc(cap);
    for (;;) {
        if (b == NULL) {
            fclose(f);
            return NULL;
        }
        n += fread(b + n, 1, cap - n, f);
        if (n < cap)
            break;
        cap *= 2;
        uint8_t *nb = realloc(b, cap);
        if (nb == NULL)
            free(b);
        b = nb;
    }
    fclose(f);
    *len_p = n;
    return b;
}

/* Runs one input in a child; returns 0 when it ran clean. */
static int replay(target_fn fn, const char *path, const char *kind)
{
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid < 0) {
        fprintf(stderr, "  FAIL %s: fork: %s\n", path, strerror(errno));
        return -1;
    }
    if (pid == 0) {
        alarm(kvt_tmo_s(15));
        size_t len = 0;
        uint8_t *data = read_file(path, &len);
        if (data == NULL) {
            fprintf(stderr, "cannot read %s\n", path);
            _exit(3);
        }
        fn(data, len);
        free(data);
        fflush(stderr);
        _exit(0);
    }
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    g_ran++;
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
        printf("  ok   %-9s %s\n", kind, path);
        return 0;
    }
    g_failed++;
    if (WIFSIGNALED(status))
        printf("  FAIL %-9s %s: killed by signal %d (%s)%s\n", kind, path, WTERMSIG(status),
               strsignal(WTERMSIG(status)),
               WTERMSIG(status) == SIGALRM ? " - hang: ran past 15 s" : "");
    else
        printf("  FAIL %-9s %s: exit status %d\n", kind, path, WEXITSTATUS(status));
    return -1;
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Replays every regular file of dir (sorted); a missing directory is fine. */
static void replay_dir(target_fn fn, const char *dir, const char *kind)
{
    DIR *d = opendir(dir);
    if (d == NULL)
        return;
    char **names = NULL;
    size_t n = 0, cap = 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        if (e->d_name[0] == '.' || strcmp(e->d_name, "README") == 0 ||
            strstr(e->d_name, ".md") != NULL)
            continue;
        if (n == cap) {
            cap = cap ? cap * 2 : 32;
            char **nn = realloc(names, sizeof(*nn) * cap);
            if (nn == NULL)
                break;
            names = nn;
        }
        names[n++] = strdup(e->d_name);
    }
    closedir(d);
    if (n)
        qsort(names, n, sizeof(*names), cmp_str);
    for (size_t i = 0; i < n; i++) {
        char path[4096];
        struct stat stt;
        snprintf(path, sizeof(path), "%s/%s", dir, names[i]);
        if (stat(path, &stt) == 0 && S_ISREG(stt.st_mode))
            replay(fn, path, kind);
        free(names[i]);
    }
    free(names);
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc > 1) {
        for (int i = 1; i < argc; i++) {
            target_fn fn = NULL;
            for (size_t t = 0; t < NUM_TARGETS; t++)
                if (strstr(argv[i], targets[t].name))
                    fn = targets[t].fn;
            if (fn == NULL) {
                fprintf(stderr, "%s: no fuzz target named in the path\n", argv[i]);
                return 2;
            }
            replay(fn, argv[i], "input");
        }
    } else {
        const char *src = getenv("KVW_SOURCE_DIR");
        if (src == NULL)
            src = "..";
        for (size_t t = 0; t < NUM_TARGETS; t++) {
            char dir[4096];
            printf("%s:\n", targets[t].name);
            snprintf(dir, sizeof(dir), "%s/fuzz/regressions/%s", src, targets[t].name);
            replay_dir(targets[t].fn, dir, "regression");
            snprintf(dir, sizeof(dir), "%s/fuzz/corpus/%s", src, targets[t].name);
            replay_dir(targets[t].fn, dir, "seed");
        }
        if (g_ran == 0) {
            fprintf(stderr, "no fuzz inputs found under %s/fuzz (set KVW_SOURCE_DIR)\n", src);
            return 1;
        }
    }
    printf("test_fuzz_regressions: %d inputs replayed, %d failed\n", g_ran, g_failed);
    return g_failed ? 1 : 0;
}
