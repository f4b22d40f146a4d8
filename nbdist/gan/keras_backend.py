"""Keras GAN backend: generator and discriminator in one flat buffer (gan/training.py),
each run statelessly from it as in backends/keras.py."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from nbdist.backends.base import ModelError
from nbdist.backends.keras import KerasBackend, call_kwargs, check_model
from nbdist.backends.keras_flat import FlatVariables, Traced, aligned_zeros, build_models
from nbdist.gan.model import GanModel
from nbdist.gan.training import GanTraining

__all__ = ["KerasGanBackend"]


def _ends_with_sigmoid(model: keras.Model) -> bool:
    layers = getattr(model, "layers", None) or [None]
    return getattr(layers[-1], "activation", None) is keras.activations.sigmoid


class KerasGanBackend(GanTraining, KerasBackend):
    def __init__(self, gan: GanModel, sample: Any = None):
        # Not KerasBackend.__init__: a GAN has two models and its own losses and metric.
        check_model(gan.generator, "generator")
        check_model(gan.discriminator, "discriminator")
        self.generator, self.discriminator = gan.generator, gan.discriminator
        build_models([self.generator, self.discriminator], [np.zeros((2, int(gan.latent_dim)), np.float32), sample])
        self._flat = FlatVariables([self.generator, self.discriminator])
        n_g, n_d = self._flat.model_sizes
        if not n_g or not n_d:
            raise ModelError("the generator and the discriminator both need trainable parameters")
        self.params, self.state = self._flat.params, self._flat.state
        self.grads = aligned_zeros(self.params.size)
        self.g_part, self.d_part = slice(0, n_g), slice(n_g, n_g + n_d)
        self._models, self._prefixes = [self.generator, self.discriminator], ["generator/", "discriminator/"]
        self._buckets, self._on_ready = [], None
        self._probabilities = _ends_with_sigmoid(self.discriminator)
        self._g_train, self._g_infer = call_kwargs(self.generator, True), call_kwargs(self.generator, False)
        self._d_train, self._d_infer = call_kwargs(self.discriminator, True), call_kwargs(self.discriminator, False)
        self._d_step = Traced(self._discriminator_step, batch=(3, 4))
        self._g_step = Traced(self._generator_step, batch=(3,))
        self._judge_step = Traced(self._judging_step, batch=(3, 4))
        self._generate_step = Traced(self._generating_step, batch=(3,))
        self._init_gan(gan, sample)

    # -- graph side -------------------------------------------------------------------
    def _bce(self, output: tf.Tensor, label: float) -> tf.Tensor:
        target = tf.fill(tf.shape(output), tf.constant(label, output.dtype))
        return tf.reduce_mean(keras.losses.binary_crossentropy(target, output, from_logits=not self._probabilities))

    def _probability(self, output: tf.Tensor) -> tf.Tensor:
        return tf.reduce_mean(output if self._probabilities else tf.sigmoid(output))

    def _discriminator_step(self, params, state, others, real, z):
        g_flat, d_flat = tf.split(params, self._flat.model_sizes)
        with tf.GradientTape() as tape:
            tape.watch(d_flat)  # the generator's weights get no gradient here
            (g_vals, d_vals), (g_nt, d_nt) = self._flat.unpack([g_flat, d_flat], state, others)
            fake, g_nt = self.generator.stateless_call(g_vals, g_nt, z, **self._g_train)
            fake = tf.stop_gradient(fake)
            out_real, d_nt = self.discriminator.stateless_call(d_vals, d_nt, real, **self._d_train)
            out_fake, d_nt = self.discriminator.stateless_call(d_vals, d_nt, fake, **self._d_train)
            loss = self._bce(out_real, 1.0) + self._bce(out_fake, 0.0)
        grad = tape.gradient(loss, d_flat, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        new_state, new_others = self._flat.pack([g_nt, d_nt])
        return grad, new_state, new_others, loss, self._probability(out_real), self._probability(out_fake)

    def _generator_step(self, params, state, others, z):
        g_flat, d_flat = tf.split(params, self._flat.model_sizes)
        with tf.GradientTape() as tape:
            tape.watch(g_flat)  # only the generator's gradient, through the discriminator
            (g_vals, d_vals), (g_nt, d_nt) = self._flat.unpack([g_flat, d_flat], state, others)
            fake, g_nt = self.generator.stateless_call(g_vals, g_nt, z, **self._g_train)
            out, d_nt = self.discriminator.stateless_call(d_vals, d_nt, fake, **self._d_train)
            loss = self._bce(out, 1.0)  # non-saturating: maximise log D(G(z))
        grad = tape.gradient(loss, g_flat, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        new_state, new_others = self._flat.pack([g_nt, d_nt])
        return grad, new_state, new_others, loss, fake

    def _generating_step(self, params, state, others, z):
        (g_vals, _), (g_nt, _) = self._flat.unpack(params, state, others)
        fake, _ = self.generator.stateless_call(g_vals, g_nt, z, **self._g_infer)
        return fake

    def _judging_step(self, params, state, others, real, z):
        (g_vals, d_vals), (g_nt, d_nt) = self._flat.unpack(params, state, others)
        fake, _ = self.generator.stateless_call(g_vals, g_nt, z, **self._g_infer)
        out_real, _ = self.discriminator.stateless_call(d_vals, d_nt, real, **self._d_infer)
        out_fake, _ = self.discriminator.stateless_call(d_vals, d_nt, fake, **self._d_infer)
        loss = self._bce(out_real, 1.0) + self._bce(out_fake, 0.0)
        return loss, self._probability(out_real), self._probability(out_fake), fake

    # -- GanTraining hooks ------------------------------------------------------------
    def _discriminator_gradient(self, real: np.ndarray, z: np.ndarray) -> tuple[float, float, float]:
        grad, state, others, loss, d_real, d_fake = self._d_step(self.params, self.state, self._flat.others, real, z)
        np.copyto(self.grads[self.d_part], grad.numpy())
        self._flat.store(self.state, state, others)
        return float(loss), float(d_real), float(d_fake)

    def _generator_gradient(self, z: np.ndarray) -> tuple[float, np.ndarray]:
        grad, state, others, loss, fake = self._g_step(self.params, self.state, self._flat.others, z)
        np.copyto(self.grads[self.g_part], grad.numpy())
        self.grads[self.d_part] = 0.0
        self._flat.store(self.state, state, others)
        return float(loss), fake.numpy()

    def _judge(self, real: np.ndarray, z: np.ndarray) -> tuple[float, float, float, np.ndarray]:
        loss, d_real, d_fake, fake = self._judge_step(self.params, self.state, self._flat.others, real, z)
        return float(loss), float(d_real), float(d_fake), fake.numpy()

    def generate(self, z: np.ndarray) -> np.ndarray:
        return self._generate_step(self.params, self.state, self._flat.others, np.asarray(z, np.float32)).numpy()
