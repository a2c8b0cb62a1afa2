"""audit/serving"""
