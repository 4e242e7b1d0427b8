/* One-row matrix products sent to cblas_sgemv (see gemv_forward.py).
 *
 * MLX's CPU backend computes every float32 product with cblas_sgemm. Loaded into the global symbol scope ahead of
 * OpenBLAS, this library's cblas_sgemm is the one MLX binds to: a row-major product whose left operand has one row
 * (a decode step's projections) becomes one cblas_sgemv over the weights, and every other product goes to
 * OpenBLAS's own sgemm. Both are handed over by courier_gemv_forward_init before MLX is imported.
 */

#include <string.h>

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

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
    if (order == ROW_MAJOR && m == 1 && n > 0 && k > 0 && plain_flags) {
        /* c (1 x n) = alpha * a (1 x k) . op(b) (k x n) + beta * c, that is c = alpha * op(b)^T . a + beta * c.
         * a's k values are contiguous when it is not transposed, else one per row of its k x 1 storage. */
        int a_step = trans_a == NO_TRANS ? 1 : lda;
        __atomic_fetch_add(&forwarded, 1, __ATOMIC_RELAXED);
        if (beta == 0.0f) { /* sgemm ignores c then; gemv may scale it, and 0 x NaN is NaN */
            memset(c, 0, (size_t)n * sizeof *c);
        }
        if (trans_b == TRANS) { /* b is stored n x k */
            openblas_sgemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, a, a_step, beta, c, 1);
        } else { /* b is stored k x n */
            openblas_sgemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, a, a_step, beta, c, 1);
        }
        return;
    }
    openblas_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
