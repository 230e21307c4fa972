"""The stages of the random-start path, in the order the driver runs them.

* :mod:`._search`: Adam on minibatches from random starts (many low-rank heads);
* :mod:`._refine`: every head refined on its own one-head problem;
* :mod:`._polish`: the joint Levenberg-Marquardt polish of all heads.
"""
