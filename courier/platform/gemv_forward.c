/* Products of a few rows sent to cblas_sgemv, a row at a time (see gemv_forward.py).
 *
 * MLX's CPU backend computes every float32 product with cblas_sgemm. Loaded into the global symbol scope ahead of
 * OpenBLAS, this library's cblas_sgemm is the one MLX binds to: a row-major product whose left operand has at most
 * GEMV_MAX_ROWS rows (a decode step's projections, for one to three sequences or a short verify) becomes one
 * cblas_sgemv over the weights per row, and every other product goes to OpenBLAS's own sgemm. Both are handed over
 * by courier_gemv_forward_init before MLX is imported.
 */

#include <string.h>

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };
/* Up to this many rows, separate gemvs beat one sgemm on a decode step's shapes (gemv_forward.py). */
enum { GEMV_MAX_ROWS = 3 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float, float *,
                         int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int, float, float *, int);

static sgemm_fn openblas_sgemm;
static sgemv_fn openblas_sgemv;
static unsigned long forwarded;

int courier_gemv_forward_init(sgemm_fn sgemm, sgemv_fn sgemv) {
    openblas_sgemm = sgemm;
    openblas_sgemv = sgemv;
    return sgemm != 0 && sgemv != 0;
}

unsigned long courier_gemv_forward_count(void) { return forwarded; }

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc) {
    int plain_flags = (trans_a == NO_TRANS || trans_a == TRANS) && (trans_b == NO_TRANS || trans_b == TRANS);
    if (order == ROW_MAJOR && m >= 1 && m <= GEMV_MAX_ROWS && n > 0 && k > 0 && plain_flags) {
        /* Row i of c (1 x n) = alpha * row i of op(a) (1 x k) . op(b) (k x n) + beta * c, that is
         * alpha * op(b)^T . a_i + beta * c_i. Row i of op(a) is row i of a's storage when a is not transposed (its k
         * values contiguous), else column i of its k x m storage (one value per row). */
        int a_step = trans_a == NO_TRANS ? 1 : lda;
        __atomic_fetch_add(&forwarded, 1, __ATOMIC_RELAXED);
        for (int row = 0; row < m; row++) {
            const float *a_row = trans_a == NO_TRANS ? a + (size_t)row * lda : a + row;
            float *c_row = c + (size_t)row * ldc;
            if (beta == 0.0f) { /* sgemm ignores c then; gemv may scale it, and 0 x NaN is NaN */
                memset(c_row, 0, (size_t)n * sizeof *c_row);
            }
            if (trans_b == TRANS) { /* b is stored n x k */
                openblas_sgemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, a_row, a_step, beta, c_row, 1);
            } else { /* b is stored k x n */
                openblas_sgemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, a_row, a_step, beta, c_row, 1);
            }
        }
        return;
    }
    openblas_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
