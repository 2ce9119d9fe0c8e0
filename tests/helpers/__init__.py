"""Test helpers: tiny assets, local S3 servers, the real stack launcher, references."""
