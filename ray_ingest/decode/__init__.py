"""Decode stage: raw member bytes -> uint8 images, caption text, embedding arrays.

``decoder`` (:class:`~ray_ingest.decode.decoder.Decoder`, what every execution runs),
``augment`` (buckets, resize, crop, crop seeds), ``jpeg`` (common JPEGs straight to libjpeg),
``sizing`` (decoded bytes per block). No Ray, no torch.
"""
