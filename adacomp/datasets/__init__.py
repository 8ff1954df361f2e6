"""Offline demo data: scikit-learn's digits, a bundled text corpus."""
