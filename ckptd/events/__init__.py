"""The trainers' elastic events, kept on storage beside their checkpoints: the event store (``_events``:
``EventStore``, one immutable file per accepted batch under ``<job>/.ckptd/events/``), what one ckptd holds of
a job's events in memory and the limits that bound it (``_event_window``), the summary the oldest events are
folded into (``_event_summary``) with the goodput of the folded stretch (``_goodput_fold``), and the settings
group that bounds them (``_settings``: ``EventSettings``).

A room of its own, below the catalog: events are a store of their own (their own files, their own bounds, their
own readers: the API's event routes, goodput, the advisor's history, ``ckptd observe``), and nothing in it needs
the catalog's steps. The catalog records its retention's decisions here (``ckptd/catalog/_retention.py``,
``record_retention``), never the other way round. Imports: the shared ``ckptd`` modules, the advisor's goodput
computation (pure) and ``trainer_client.core``'s faces (docs/architecture.md, "Package map").
"""
