"""A package written against kfac-jax 0.0.8, as FermiNet and DeepQMC are: it imports ``kfac_jax``
and its submodules in several modules and in several spellings. It is not edited to run with
curvax; ``tests/test_kfac_jax_switch.py`` runs it with ``curvax.install_as_kfac_jax``."""

import kfac_jax

VERSION = kfac_jax.__version__
