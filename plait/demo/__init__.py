"""The demos ``plait demo`` runs: the digits CNN (:mod:`~plait.demo.digits`), the GPT on
any layout (:mod:`~plait.demo.gpt`, its layouts in :mod:`~plait.demo.layouts`) and the tour
of five layouts (:mod:`~plait.demo.tour`)."""
