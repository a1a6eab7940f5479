"""The demos ``plait demo`` runs: the digits CNN (:mod:`~plait.demo.digits`), the GPT on
any layout (:mod:`~plait.demo.gpt`, its layouts in :mod:`~plait.demo.layouts`, context
parallelism's options and byte check in :mod:`~plait.demo.context`) and the tour
(:mod:`~plait.demo.tour`: the reference trained in one process by
:mod:`~plait.demo.reference`, six layouts continuing it, pictures by
:mod:`~plait.demo.pictures`); what ``--check`` measures is in
:mod:`~plait.demo.closeness`."""
