"""The stages of the random-start path, in the order the driver runs them.

* :mod:`._search`: Adam on minibatches from random starts (many low-rank heads);
* :mod:`._refine`: every head refined on its own one-head problem, in stages:
  the rounds of one-head solves (:mod:`._rounds`), heads the sequences do not
  pin (:mod:`._pinning`), heads stuck near on more sequences
  (:mod:`._more_sequences`), far heads searched afresh (:mod:`._search_afresh`),
  heads restarted from their patterns (:mod:`._from_patterns`, by
  :mod:`._sharp_heads`);
* :mod:`._polish`: the joint Levenberg-Marquardt polish of all heads.

:mod:`._common` holds the array and thread helpers the stages share.
"""
