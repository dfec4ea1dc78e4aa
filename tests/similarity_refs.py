"""Ports of the reference implementations featcache's similarity measures are tested against.

1. google-research/google-research, representation_similarity/Demo.ipynb at commit
   10bf941a5a0625bf27bb8443aa849e9b48fdd5f9, code cell ``MkucRi3yn7UJ`` (JSON lines 52-197):
   ``gram_linear`` (l. 52), ``gram_rbf`` (l. 64), ``center_gram`` (l. 83), ``cka`` (l. 122),
   ``_debiased_dot_product_similarity_helper`` (l. 145), ``feature_space_linear_cka`` (l. 156).
   Statements as in the notebook (2-space indentation reformatted).
2. google-research/google-research, do_wide_and_deep_networks_learn_the_same_things/efficient_CKA.py
   (2022 copy): ``MinibatchCKA._generate_gram_matrix`` (l. 54-79), ``update_state_across_models``
   (l. 95-117) and ``result`` (l. 119-133), TensorFlow ops replaced by their numpy equivalents
   (``# port:``), one layer per model.
3. ViCCo-Group/thingsvision, thingsvision/core/cka/cka_numpy.py at commit
   05761d93d9ae86e0a48e7bf75ca487dd3c315ce2: ``CKANumPy.centering`` (l. 25-45),
   ``linear_kernel``/``rbf_kernel`` (l. 55-71), ``_hsic`` (l. 73-80), ``compare`` (l. 82-88);
   and thingsvision/core/rsa/helpers.py at commit c5e70b18cb2dadf761d6254b1c9af8c971f2ca60:
   ``correlation_matrix`` (l. 29), ``cosine_matrix`` (l. 39), ``compute_rdm`` (l. 49),
   ``correlate_rdms`` (l. 81).
"""

from __future__ import annotations

import math

import numpy as np
import scipy.stats


# ---------------------------------------------------------------- 1. the notebook
def gram_linear(x):
    return x.dot(x.T)


def gram_rbf(x, threshold=1.0):
    dot_products = x.dot(x.T)
    sq_norms = np.diag(dot_products)
    sq_distances = -2 * dot_products + sq_norms[:, None] + sq_norms[None, :]
    sq_median_distance = np.median(sq_distances)
    return np.exp(-sq_distances / (2 * threshold**2 * sq_median_distance))


def center_gram(gram, unbiased=False):
    if not np.allclose(gram, gram.T):
        raise ValueError("Input must be a symmetric matrix.")
    gram = gram.copy()
    if unbiased:
        n = gram.shape[0]
        np.fill_diagonal(gram, 0)
        means = np.sum(gram, 0, dtype=np.float64) / (n - 2)
        means -= np.sum(means) / (2 * (n - 1))
        gram -= means[:, None]
        gram -= means[None, :]
        np.fill_diagonal(gram, 0)
    else:
        means = np.mean(gram, 0, dtype=np.float64)
        means -= np.mean(means) / 2
        gram -= means[:, None]
        gram -= means[None, :]
    return gram


def cka(gram_x, gram_y, debiased=False):
    gram_x = center_gram(gram_x, unbiased=debiased)
    gram_y = center_gram(gram_y, unbiased=debiased)
    scaled_hsic = gram_x.ravel().dot(gram_y.ravel())
    normalization_x = np.linalg.norm(gram_x)
    normalization_y = np.linalg.norm(gram_y)
    return scaled_hsic / (normalization_x * normalization_y)


def _debiased_dot_product_similarity_helper(
    xty, sum_squared_rows_x, sum_squared_rows_y, squared_norm_x, squared_norm_y, n
):
    return (
        xty
        - n / (n - 2.0) * sum_squared_rows_x.dot(sum_squared_rows_y)
        + squared_norm_x * squared_norm_y / ((n - 1) * (n - 2))
    )


def feature_space_linear_cka(features_x, features_y, debiased=False):
    features_x = features_x - np.mean(features_x, 0, keepdims=True)
    features_y = features_y - np.mean(features_y, 0, keepdims=True)
    dot_product_similarity = np.linalg.norm(features_x.T.dot(features_y)) ** 2
    normalization_x = np.linalg.norm(features_x.T.dot(features_x))
    normalization_y = np.linalg.norm(features_y.T.dot(features_y))
    if debiased:
        n = features_x.shape[0]
        sum_squared_rows_x = np.einsum("ij,ij->i", features_x, features_x)
        sum_squared_rows_y = np.einsum("ij,ij->i", features_y, features_y)
        squared_norm_x = np.sum(sum_squared_rows_x)
        squared_norm_y = np.sum(sum_squared_rows_y)
        dot_product_similarity = _debiased_dot_product_similarity_helper(
            dot_product_similarity, sum_squared_rows_x, sum_squared_rows_y, squared_norm_x, squared_norm_y, n
        )
        normalization_x = np.sqrt(
            _debiased_dot_product_similarity_helper(
                normalization_x**2, sum_squared_rows_x, sum_squared_rows_x, squared_norm_x, squared_norm_x, n
            )
        )
        normalization_y = np.sqrt(
            _debiased_dot_product_similarity_helper(
                normalization_y**2, sum_squared_rows_y, sum_squared_rows_y, squared_norm_y, squared_norm_y, n
            )
        )
    return dot_product_similarity / (normalization_x * normalization_y)


# ---------------------------------------------------------------- 2. efficient_CKA.py
class MinibatchCKA:
    """``MinibatchCKA(1, 1, across_models=True)`` of efficient_CKA.py, in numpy."""

    def __init__(self):
        self.hsic_accumulator = np.zeros((1, 1))  # port: add_weight(zeros)
        self.hsic_accumulator_model1 = np.zeros((1,))
        self.hsic_accumulator_model2 = np.zeros((1,))

    def _generate_gram_matrix(self, x):
        x = np.reshape(x, (x.shape[0], -1))
        gram = x @ x.T  # port: tf.matmul(x, x, transpose_b=True)
        n = gram.shape[0]
        np.fill_diagonal(gram, 0)  # port: tf.linalg.set_diag(gram, zeros)
        gram = gram.astype(self.hsic_accumulator.dtype)
        means = np.sum(gram, 0) / (n - 2)
        means -= np.sum(means) / (2 * (n - 1))
        gram -= means[:, None]
        gram -= means[None, :]
        np.fill_diagonal(gram, 0)
        return np.reshape(gram, (-1,))

    def update_state_across_models(self, activations1, activations2):
        layer_grams1 = np.stack([self._generate_gram_matrix(x) for x in activations1], 0)
        layer_grams2 = np.stack([self._generate_gram_matrix(x) for x in activations2], 0)
        self.hsic_accumulator += layer_grams1 @ layer_grams2.T
        self.hsic_accumulator_model1 += np.einsum("ij,ij->i", layer_grams1, layer_grams1)
        self.hsic_accumulator_model2 += np.einsum("ij,ij->i", layer_grams2, layer_grams2)

    def result(self):
        mean_hsic = self.hsic_accumulator.copy()
        normalization1 = np.sqrt(self.hsic_accumulator_model1)
        normalization2 = np.sqrt(self.hsic_accumulator_model2)
        mean_hsic /= normalization1[:, None]
        mean_hsic /= normalization2[None, :]
        return mean_hsic


# ---------------------------------------------------------------- 3. thingsvision
class CKANumPy:
    def __init__(self, m, kernel, unbiased=False, sigma=1.0):
        self.m, self.kernel, self.unbiased, self.sigma = m, kernel, unbiased, sigma

    def centering(self, K):
        if not np.allclose(K, K.T, rtol=1e-03, atol=1e-04):
            raise ValueError("\nInput array must be a symmetric matrix.\n")
        if self.unbiased:
            n = K.shape[0]
            np.fill_diagonal(K, 0.0)
            means = np.sum(K, axis=0, dtype=np.float64) / (n - 2)
            means -= np.sum(means) / (2 * (n - 1))
            K -= means[:, None]
            K -= means[None, :]
            np.fill_diagonal(K, 0.0)
        else:
            means = np.mean(K, axis=0, dtype=np.float64)
            means -= np.mean(means) / 2
            K -= means[:, None]
            K -= means[None, :]
        return K

    def apply_kernel(self, X):
        return getattr(self, f"{self.kernel}_kernel")(X)  # port: AttributeError -> NotImplementedError dropped

    def linear_kernel(self, X):
        return X @ X.T

    def rbf_kernel(self, X, sigma=1.0):
        GX = X @ X.T
        KX = np.diag(GX) - GX + (np.diag(GX) - GX).T
        if sigma is None:
            mdist = np.median(KX[KX != 0])
            sigma = math.sqrt(mdist)
        KX *= -0.5 / sigma**2
        KX = np.exp(KX)
        return KX

    def _hsic(self, X, Y):
        K = self.apply_kernel(X)
        L = self.apply_kernel(Y)
        K_c = self.centering(K)
        L_c = self.centering(L)
        return np.sum(K_c * L_c)

    def compare(self, X, Y):
        hsic_xy = self._hsic(X, Y)
        hsic_xx = self._hsic(X, X)
        hsic_yy = self._hsic(Y, Y)
        return hsic_xy / np.sqrt(hsic_xx * hsic_yy)


def correlation_matrix(X, a_min=-1.0, a_max=1.0):
    F_c = X - X.mean(axis=1)[:, np.newaxis]
    cov = F_c @ F_c.T
    l2_norms = np.linalg.norm(F_c, axis=1)
    denom = np.outer(l2_norms, l2_norms)
    return (cov / denom).clip(min=a_min, max=a_max)


def cosine_matrix(X, a_min=-1.0, a_max=1.0):
    num = X @ X.T
    l2_norms = np.linalg.norm(X, axis=1)
    denom = np.outer(l2_norms, l2_norms)
    return (num / denom).clip(min=a_min, max=a_max)


def compute_rdm(X, method):
    rsm = correlation_matrix(X) if method == "correlation" else cosine_matrix(X)  # port: the two methods featcache has
    return 1 - rsm


def correlate_rdms(rdm_1, rdm_2, correlation="pearson"):
    triu_inds = np.triu_indices(len(rdm_1), k=1)
    corr_func = getattr(scipy.stats, "".join((correlation, "r")))
    return corr_func(rdm_1[triu_inds], rdm_2[triu_inds])[0]
