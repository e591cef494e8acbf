/* Runs the GGUF library's products (plugins/quant/csrc/gguf_cpu.c, linked in as built) for every
 * kernel set this CPU runs, for tests that cannot load the library into Python: a build for
 * another CPU, run under an emulator (tests/plugins/quant/test_gguf_neon.py).
 *
 * Usage: driver CASES OUT. CASES: int32 count, then per case int32 type, M, K, N, threads,
 * row_bytes, N * row_bytes bytes of weight rows, M * K float32 activations. Prints the best kernel
 * set (gguf_cpu_isa) and writes to OUT, per case and per kernel set 0 .. 2: int32 status of
 * gguf_mul_mat, then M * N float32 results (zeros where the status is not 0). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int gguf_cpu_isa(void);
int gguf_mul_mat(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t w_stride, int64_t N, int type,
                 float *out, int num_threads, int isa);

static void *read_exact(FILE *f, size_t bytes) {
    void *p = calloc(bytes ? bytes : 1, 1);
    if (!p || fread(p, 1, bytes, f) != bytes) {
        fprintf(stderr, "driver: short input\n");
        exit(2);
    }
    return p;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s CASES OUT\n", argv[0]);
        return 2;
    }
    FILE *in = fopen(argv[1], "rb"), *out = fopen(argv[2], "wb");
    if (!in || !out) {
        perror("driver");
        return 2;
    }
    printf("isa %d\n", gguf_cpu_isa());
    int32_t *count = read_exact(in, 4);
    for (int32_t c = 0; c < *count; c++) {
        int32_t *h = read_exact(in, 6 * 4); /* type, M, K, N, threads, row_bytes */
        uint8_t *w = read_exact(in, (size_t)h[3] * (size_t)h[5]);
        float *x = read_exact(in, (size_t)h[1] * (size_t)h[2] * 4);
        for (int32_t isa = 0; isa <= 2; isa++) {
            float *o = calloc((size_t)h[1] * (size_t)h[3] + 1, 4);
            const int32_t status = gguf_mul_mat(x, h[1], h[2], w, h[5], h[3], h[0], o, h[4], isa);
            fwrite(&status, 4, 1, out);
            fwrite(o, 4, (size_t)h[1] * (size_t)h[3], out);
            free(o);
        }
        free(h); free(w); free(x);
    }
    free(count);
    return fclose(out) == 0 ? 0 : 1;
}
