/* Small-file workload for bench/small_bench.py: one process, no interpreter in the way.
 *
 *   smallfiles DIR COUNT SIZE [PHASE]
 *
 * PHASE "create" (DIR is created and must not exist): COUNT files f000000..
 * are each created (open O_WRONLY|O_CREAT|O_EXCL, 0644), written SIZE bytes
 * with one write(2) and closed. "stat": each is stat(2)'ed (its size
 * checked). "unlink": each is unlink(2)'ed, then DIR is removed. "all" (the
 * default): the three in a row. Prints one JSON object with the seconds of
 * each phase run. Exit status 1 (and the failing call on stderr) on any error.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void die(const char *what, const char *path) {
    fprintf(stderr, "%s %s: %s\n", what, path, strerror(errno));
    exit(1);
}

static int want(const char *phase, const char *name) {
    return strcmp(phase, "all") == 0 || strcmp(phase, name) == 0;
}

int main(int argc, char **argv) {
    if (argc != 4 && argc != 5) {
        fprintf(stderr, "usage: %s DIR COUNT SIZE [create|stat|unlink|all]\n", argv[0]);
        return 2;
    }
    const char *dir = argv[1];
    long count = atol(argv[2]);
    size_t size = (size_t)atol(argv[3]);
    const char *phase = argc == 5 ? argv[4] : "all";
    char *buf = malloc(size ? size : 1);
    char path[4096];
    struct stat st;
    const char *sep = "{";
    memset(buf, 'x', size);
    if (want(phase, "create")) {
        if (mkdir(dir, 0755) != 0)
            die("mkdir", dir);
        double t0 = now();
        for (long i = 0; i < count; i++) {
            snprintf(path, sizeof path, "%s/f%06ld", dir, i);
            int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
            if (fd < 0)
                die("open", path);
            if (size && write(fd, buf, size) != (ssize_t)size)
                die("write", path);
            if (close(fd) != 0)
                die("close", path);
        }
        printf("%s\"create_write_close\": %.6f", sep, now() - t0);
        sep = ", ";
    }
    if (want(phase, "stat")) {
        double t0 = now();
        for (long i = 0; i < count; i++) {
            snprintf(path, sizeof path, "%s/f%06ld", dir, i);
            if (stat(path, &st) != 0)
                die("stat", path);
            if ((size_t)st.st_size != size) {
                errno = EIO;
                die("stat size", path);
            }
        }
        printf("%s\"stat\": %.6f", sep, now() - t0);
        sep = ", ";
    }
    if (want(phase, "unlink")) {
        double t0 = now();
        for (long i = 0; i < count; i++) {
            snprintf(path, sizeof path, "%s/f%06ld", dir, i);
            if (unlink(path) != 0)
                die("unlink", path);
        }
        printf("%s\"unlink\": %.6f", sep, now() - t0);
        if (rmdir(dir) != 0)
            die("rmdir", dir);
    }
    printf("}\n");
    return 0;
}
